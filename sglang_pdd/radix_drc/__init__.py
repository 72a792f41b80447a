"""Decode-side radix cache (DRC) on Main Decode: keeps prior turns so only the uncached suffix crosses the WAN."""
