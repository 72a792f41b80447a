"""Service discovery: which pods are the router's backends (``--service-discovery``).

watch.py lists and watches the Kubernetes API (or MD's discovery file); pods.py, pure, turns
pod events into joins, drains and leaves; apply.py applies them to the pools (a new backend is
added once its /health answers). The flags that build it: front/discovery_setup.py.
"""
