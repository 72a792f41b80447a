"""The shared key's one rule (pure): both planes derive their keys from it.

The WAN handshake (kv_channel/handshake.py) and the control plane (control/auth.py) both take
the deployment's shared key; the bound lives here, below both, so neither imports the other.
"""

MIN_KEY_BYTES = 32  # 256 bits: the session keys derived from it are HMAC-SHA256 keys
