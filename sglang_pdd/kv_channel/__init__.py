"""Transport of KV caches: the WAN channel (TCP), its emulator, and the SGLang transfer backend."""
