"""P's WAN leg: the pages MD lacks, sent over the WAN while prefill makes them.

One request's course on P (``--pdd-role prefill``):
1. The router posts the request's WAN destination (MD's room, its prefix length, its TP size),
   before or after the request itself: prefill_control.py (``PrefillControlApi``; the
   ``DestinationBoard`` pairs the destination with the request's sender).
2. SGLang builds the request's sender (transfer_backend.py, ``PddKVSender``); plugin.py's hook
   binds the request to it. Whether and where its KV goes to MD is the machine in
   wan_binding.py: AWAITING_DESTINATION -> DESTINATION_KNOWN -> OPENING -> OPEN, or DROPPED.
3. Once open, wan_fanout.py (``WanFanout``) takes every page the sender is given: a copy thread
   copies each complete page group out of the pool (kv_pool_view.py), a send thread hands the
   copies to kv_channel's ``WanKvSender``, one share per MD TP rank fed.
4. The room's phase is the machine in fanout_room.py: RECEIVING -> OFFERED -> SENT, or
   CANCELLED / FAILED. P frees the pages once the copies are taken, never waiting on the WAN;
   a failed WAN leg fails only MD's room, and RLD finishes the request.
"""
