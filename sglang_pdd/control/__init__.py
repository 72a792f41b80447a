"""The control plane every stdlib control server shares (MD's rooms, P's WAN destinations, the
WAN emulator's faults).

A call's course: the client signs it (auth.py, ``ControlSigner``: HMAC over method, path, host,
time, nonce and body hash); the server's gate (gate.py: ``ControlHTTPServer`` admits the
connection by source and caps, ``JsonRequestHandler`` verifies the signature before any route
runs) dispatches it to a bound method of one ``ControlApi`` (api.py), whose reply is signed back.
"""
