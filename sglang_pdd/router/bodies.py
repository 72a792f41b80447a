"""The request bodies the router sends to P, RLD and MD (pure).

Built here, in one place, so that what drives the servers without the router (benchmarks,
tests) sends exactly what the router sends.
"""

from __future__ import annotations

from typing import Optional, Sequence


def register_body(room: int, token_ids: list[int], use_cache: bool = True) -> dict:
    """MD's ``POST /pdd/rooms``: match the prompt in MD's cache (unless ``use_cache`` is off)
    and hold a room for its KV."""
    return {"room": room, "token_ids": token_ids, "use_cache": use_cache}


def wan_destination_params(room: int, wan_peer: str, md_prefix_len: int, md_tp: int = 1) -> dict:
    """The ``custom_params`` telling P's plugin where to send the prompt's KV over the WAN
    (MD's room and WAN address) and which part MD already holds."""
    return {"pdd_room": room, "pdd_wan_peer": wan_peer, "pdd_md_prefix_len": md_prefix_len,
            **({"pdd_md_tp": md_tp} if md_tp != 1 else {})}


def pd_leg_body(input_ids: list[int], sampling: dict, rid: str, bootstrap_host: str, bootstrap_port: int,
                bootstrap_room: int, extras: Optional[dict] = None) -> dict:
    """The one body P and RLD both get for a leg, as SGLang PD does it (same bootstrap room)."""
    return {"input_ids": input_ids, "sampling_params": sampling, "rid": rid, **(extras or {}),
            "bootstrap_host": bootstrap_host, "bootstrap_port": bootstrap_port, "bootstrap_room": bootstrap_room}


def handoff_body(eager: Sequence[int], rid: str, sampling: dict, extras: Optional[dict] = None) -> dict:
    """The final handoff to MD: MD continues the request after the ``eager`` tokens and streams
    it from position 0; ``max_new_tokens`` in ``sampling`` is the whole budget, eager tokens
    included."""
    return {"token_ids": eager, "rid": rid, "sampling_params": sampling, "stream": True, "warmup": False,
            **(extras or {})}
