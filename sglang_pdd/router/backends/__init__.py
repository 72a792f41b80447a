"""The servers behind the router: what it knows of them and how it calls them.

* servers.py — the record of each P and MD (URLs, control API, WAN peer, measured sizes).
* pools.py — P, RLD and MD servers, their requests in flight and the pick of one of each
  (placement.py: load-aware with prefix affinity over prefix_index.py; health.py: a circuit
  breaker per server and pair; wan_in_flight.py: the WAN bytes planned); loads.py reads the
  servers' measured speed from SGLang's /v1/loads.
* clients.py — the async clients: SGLang /generate streams (decoded by stream_decode.py) and
  MD's and P's signed control APIs (mutual TLS: control_tls.py), each reply read within
  reply_limits.py; kv_senders.py tells each MD which P hosts send it KV.
* stall.py — when a relay leg counts as stalled (its servers made no progress the router saw),
  the rule clients.until_relay_stalled applies to RLD's stream.
"""
