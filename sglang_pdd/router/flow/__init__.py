"""One request item through PDD, from its opened flow to its last token.

1. pdd_flow.py — ``PddFlow``, the async I/O shell the runner (front/flow_runner.py) opens: it
   chooses the path (router/policy.py), starts P's and RLD's legs with bodies from bodies.py,
   turns every backend reply into an event of the pure machine in lifecycle.py
   (``transition(state, event) -> (state, actions)``: STARTING -> RELAY -> HANDING_OFF -> MAIN,
   ending DONE, FAILED or CLOSED) and performs the actions it returns.
2. md_side.py — ``MdSide``: the flow's I/O with MD's control API and P's WAN destinations
   (register, deliver, wait ready, catch up, final handoff, release), told back as events.
3. fallback.py — why a request left its planned path, as a typed record.
"""
