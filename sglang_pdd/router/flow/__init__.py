"""One request item through PDD, from its opened flow to its last token.

1. request.py, pick.py — what a flow is opened with: the settled request (``FlowRequest``),
   the servers front/flow_runner.py's ``FlowRunner.open`` picked and what the router knew of
   them then (``ServerPick``, frozen), and what every flow shares (``FlowShared``).
2. pdd_flow.py — ``PddFlow(req, pick, cfg, shared)``, the async I/O shell: it chooses the path
   (router/policy.py), starts P's and RLD's legs with bodies from bodies.py, turns every backend
   reply into an event of the pure machine in lifecycle.py (``transition(state, event) ->
   (state, actions)``: STARTING -> RELAY -> HANDING_OFF -> MAIN, ending DONE, FAILED or CLOSED)
   and performs the actions it returns.
3. md_side.py — ``MdSide(io, pick, ...)``: the flow's I/O with MD's control API and P's WAN
   destinations (register, deliver, wait ready, catch up, final handoff, release), told back
   as events through the flow's ``FlowIo``.
4. fallback.py — why a request left its planned path, as a typed record.
"""
