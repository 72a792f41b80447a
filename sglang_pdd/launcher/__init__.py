"""Start a real local PDD topology (P, RLD, MD, router, WAN emulator) as separate processes."""
