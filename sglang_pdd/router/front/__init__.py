"""The router's HTTP face: what a client meets, up to the flow that serves it.

cli.py parses the flags and builds the app (app.py: aiohttp routes, the ``Router`` that holds
the pools, the flow runner and the metrics), or N of them behind one port (workers.py, drains
shared through shared_drain.py); discovery_setup.py adds service discovery. A request passes
the client's key and TLS (client_auth.py), the overload gate (overload.py), SGLang's own
/generate and OpenAI handlers on ``PddTokenizerManager`` (serving.py, openai_front.py; the
request's scope: scope.py) with the router's strict checks (validate.py). Each item is settled
once (``FlowRequest``, router/flow/request.py) and run by the ``FlowRunner`` (flow_runner.py:
pick the servers into a ``ServerPick``, open a ``PddFlow``, account for it, retry one that
broke before its first token); its tokens come back detokenized as SGLang does it
(detokenize.py), counted in metrics.py.
"""
