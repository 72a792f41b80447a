"""The PDD router: path choice (P->MD, P->RLD->MD, outlier filter) and SGLang's API in front.

A request's course through the router, by folder (each imports only the ones below it):
* front/ — the HTTP face: cli.py builds the ``Router`` (app.py, aiohttp); a request passes the
  client's key (client_auth.py), its checks (validate.py) and the overload gate (overload.py),
  and SGLang's own serving code runs it over ``PddTokenizerManager`` (serving.py,
  openai_front.py), which settles each item (``FlowRequest``) and hands it to the
  ``FlowRunner`` (flow_runner.py), which picks its servers (``ServerPick``);
* discovery/ — which pods are the backends (pods.py, pure), watched (watch.py) and applied
  to the pools (apply.py); front/discovery_setup.py builds it from the flags;
* flow/ — one request item: ``PddFlow(req, pick, cfg, shared)`` (pdd_flow.py; its records in
  request.py and pick.py), whose course is the pure machine in lifecycle.py; MD's I/O is its
  ``MdSide`` (md_side.py); a fallback is a typed record (fallback.py);
* backends/ — the servers behind: their records (servers.py), pools, health breakers,
  placement, prefix index and measured loads, and the clients that call them (clients.py);
* policy.py — the path decision itself (pure), at the top: the simulator reuses it.
"""
