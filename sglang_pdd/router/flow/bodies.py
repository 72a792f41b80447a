"""The request bodies the router sends to P, RLD and MD (pure).

Built here, in one place, from the control protocol's types (sglang_pdd.protocol), so that
what drives the servers without the router (benchmarks, tests) sends exactly what the
router sends.
"""

from __future__ import annotations

from typing import Optional, Sequence

from sglang_pdd.protocol import HandoffRequest, LegParams


def wan_destination_params(room: int, wan_peer: str, md_prefix_len: int, md_tp: int = 1) -> dict:
    """The ``custom_params`` telling P's plugin where to send the prompt's KV over the WAN
    (MD's room and WAN address) and which part MD already holds."""
    return LegParams.destination(room, wan_peer, md_prefix_len, md_tp).to_json()


def late_destination_params(room: int) -> dict:
    """The ``custom_params`` telling P its WAN destination comes later (its control API)."""
    return LegParams.late(room).to_json()


def pd_leg_body(input_ids: list[int], sampling: dict, rid: str, bootstrap_host: str, bootstrap_port: int,
                bootstrap_room: int, extras: Optional[dict] = None) -> dict:
    """The one body P and RLD both get for a leg, as SGLang PD does it (same bootstrap room)."""
    return {"input_ids": input_ids, "sampling_params": sampling, "rid": rid, **(extras or {}),
            "bootstrap_host": bootstrap_host, "bootstrap_port": bootstrap_port, "bootstrap_room": bootstrap_room}


def handoff_body(eager: Sequence[int], rid: str, sampling: dict, extras: Optional[dict] = None) -> HandoffRequest:
    """The final handoff to MD: MD continues the request after the ``eager`` tokens and streams
    it from position 0; ``max_new_tokens`` in ``sampling`` is the whole budget, eager tokens
    included. ``extras``: SGLang's logprob fields (HandoffRequest's)."""
    return HandoffRequest(list(eager), rid, sampling, stream=True, warmup=False, **(extras or {}))


def warmup_body(handed: Sequence[int], rid: str, sampling: dict) -> HandoffRequest:
    """A catch-up batch: MD extends its cache by the ``handed`` tokens, its output discarded
    (no min_new_tokens, which MD's one-token warmup would refuse)."""
    return HandoffRequest(list(handed), rid, {k: v for k, v in sampling.items() if k != "min_new_tokens"},
                          stream=False, warmup=True)
