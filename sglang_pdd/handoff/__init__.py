"""Relay Decode -> Main Decode handoff: wire messages, planning (one-shot / catch-up), stream stitching."""
