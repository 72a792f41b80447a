"""MD's runtime (``--pdd-role main``): WAN KV lands in SGLang's own radix cache, MD's DRC.

Life of a room, from registration to release (main_drc.py's ``MainDrcRuntime`` holds the parts):
1. Register: the router's call reaches ``MdControlApi.register`` (main_drc.py) on a control
   thread, which queues a command (driver.py's ``CommandQueue``) and wakes the sleeping
   scheduler (idle_wake.py).
2. Apply: on the scheduler thread, ``LockstepDriver.iterate`` (driver.py) applies it on every
   TP rank to that rank's rooms (rooms.py): radix match, pool pages reserved for the missing KV
   (ingest.py, under the bytes-in-flight budget); the ranks agree (lockstep.py, tp_sync.py).
3. Land: kv_channel's ``WanKvReceiver`` writes each chunk from P into the reserved pages
   (ingest.py, kv_pool_view.py); when all has landed the scheduler inserts the prompt into the
   radix tree (main_drc.py's ``SglangTreeOps.ingest``). The room's phase is
   radix_drc/room_state.py's machine.
4. Hand off: ``wait_ready`` and ``handoff_request`` (queries.py) turn the router's handoff into
   MD's own /generate with the eager tokens marked as output (resume.py), sent over loopback
   (loopback.py); the stream is relayed to the router, cut short if it hangs up (hangup_watch.py).
5. Release: the router's release (rooms.py) ends the room; its pages go back once no receiver
   thread writes them (pages.py). Evictions of the cache are counted as SGLang reports them
   (evictions.py).
"""
