"""Faults under load: a chaos run on the local cluster that checks nothing is lost.

Open-loop streaming load from a real client while faults fire (kill -9 of P, RLD and MD, the
WAN link down and slowed, the router restarted, MD drained and slowed); afterwards every
request is checked against one plain server's greedy output, every stream for repeated or
skipped tokens, every backend for what it still holds, and the router's metrics for each fault.

Pure parts (no I/O, unit-tested without servers): ``spec`` (faults, scenarios, the soak's
schedule, the load's prompts and arrivals), ``checks`` (streams, statuses, leaks, metrics,
the per-scenario row). I/O: ``load`` (the client), ``faults`` (what makes each fault happen),
``probe`` (what the servers hold, the router's metrics), ``runner`` (a cluster, the reference
server, the scenarios). ``python -m sglang_pdd.chaos --help``; docs/faults.md.
"""
