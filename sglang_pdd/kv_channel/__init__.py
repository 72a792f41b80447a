"""Moving KV caches between processes, with no SGLang import: the WAN channel (P -> MD) and
the intra-DC engine that stands in for Mooncake (P -> RLD). The SGLang transfer backend that
drives them is sglang_glue/transfer_backend.py; the WAN emulator is launcher/wan_emulator.py.

One job per module:

* ``wire``            frame codec (fixed prefix + msgpack header + raw payload), messages, limits
* ``handshake``       mutual HMAC-SHA256 challenge-response on a shared key
* ``tls``             mutual TLS contexts (the WAN channel's and the control plane's)
* ``acceptor``        bounded, authenticated accepting, shared by the receiver and the engine
* ``handshake_slot``  one accepted connection's place before it authenticates (a machine)
* ``layout``          KvLayout and TransferPlan: which pages (>= decode_prefix_len) go, in which chunks
* ``tp_relayout``     which bytes go to which MD rank when P's and MD's TP sizes differ
* ``contract``        what a sender and a receiver provide (KvSender, KvTransfer, KvReceiver, their
                      shared RoomEndpoint), RoomState (SGLang's KVPoll numbers), FailureReason
* ``send_room``       one room on the WAN sender (a machine); ``wan_sender`` its I/O: WanKvSender,
                      N striped TCP streams, a bounded window, a poll per room
* ``recv_room``       one room on the WAN receiver (a machine); ``wan_receiver`` its I/O:
                      WanKvReceiver, registered rooms, validation, zero-copy writes
* ``tcp_engine``      Mooncake's TransferEngine surface over authenticated TCP (intra-DC)
* ``fallback``        Mooncake if importable, else ``tcp_engine``, for the intra-DC path

See docs/kv_channel.md.
"""
