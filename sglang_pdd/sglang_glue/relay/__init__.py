"""RLD, the relay: a plain SGLang PD decode server (``--pdd-role relay``) that decodes until MD
takes the request over.

It receives P's KV through SGLang's own PD decode path (transfer_backend.py's receiver is
Mooncake's), so only two things are its own:
* penalty_clock.py — penalties count tokens on one server's clock: the first decode after a
  PD transfer counts ``prompt[-1]`` as one server does; MD's resume (md/resume.py) seeds its
  penalizers from the same clock (``history``), so a handoff changes no sampled token;
* relay_hold.py — test-only: RLD pauses once a request has N output tokens, so a test can hand
  the request to MD at exactly that point.
"""
