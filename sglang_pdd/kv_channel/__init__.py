"""Transport of KV caches: the WAN channel (TCP), its emulator, and the SGLang transfer backend.

Standalone layer (no SGLang import), one job per module:

* ``wire``          frame codec (fixed prefix + msgpack header + raw payload), messages, limits
* ``handshake``     mutual HMAC-SHA256 challenge-response on a shared key
* ``layout``        KvLayout and TransferPlan: which pages (>= decode_prefix_len) go, in which chunks
* ``states``        RoomState (same numbers as SGLang's KVPoll) and FailureReason
* ``wan_sender``    WanKvSender / Transfer: N striped TCP streams, bounded window, per-room poll
* ``wan_receiver``  WanKvReceiver: registered rooms, validation, zero-copy writes to a destination
* ``wan_emulator``  userspace TCP proxy imposing rate, latency, jitter and faults (also a CLI)
* ``fallback``      Mooncake if importable, else the TCP channel for the intra-DC path

See docs/kv_channel.md.
"""
