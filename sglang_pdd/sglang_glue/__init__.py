"""Everything that touches SGLang internals: the plugin SGLang loads in P's, RLD's and MD's processes.

At this level, what every role shares:
* plugin.py — the entry point (``sglang.srt.plugins``: ``pdd``); registers the HookRegistry
  hooks and the ``pdd`` transfer backend, each inert unless ``--pdd-role`` asks for it;
* transfer_backend.py — ``--disaggregation-transfer-backend pdd``: SGLang's Mooncake contracts
  subclassed, P's sender also feeding the WAN leg (p/), RLD's receiver unchanged;
* servable.py — what PDD refuses at start, named; compile_warmup.py, mla_attention.py — SGLang
  adjustments every role needs;
* kv_pool_view.py, kv_buffer_groups.py — one request's pages in SGLang's pools, in the WAN
  channel's layout (P reads them, MD writes them);
* injected_delays.py — test-only delays at the two rendezvous (P's late destination, MD's room).

By role:
* p/ — P's WAN leg: the router's late destination, the fan-out of each request's pages to MD;
* relay/ — RLD (a plain SGLang PD decode server): its penalty clock, a test-only hold;
* md/ — MD's runtime: a room from registration to release, inside MD's scheduler process.
"""
