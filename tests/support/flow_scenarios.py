"""One request through PddFlow against fresh fake P / RLD / MD servers (fake_backends), and
the checks every such run must pass: the client gets truth[:max_new] exactly (no loss, no
duplicate, in order), MD's room released exactly once, no backend stream or task left. Shared
by the router's flow, contract, late-destination, MD-TP and TLS tests."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Optional

import aiohttp

from sglang_pdd.handoff.policy import HandoffConfig, HandoffMode
from sglang_pdd.router.backends.clients import BackendError, use_control_key
from sglang_pdd.router.flow.fallback import Reason
from sglang_pdd.router.flow.lingering import Lingering
from sglang_pdd.router.flow.pdd_flow import FlowConfig, PddFlow
from sglang_pdd.router.flow.request import FlowRequest
from sglang_pdd.router.flow.pick import FlowShared, ServerPick
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.router.policy import Path, PathPolicyConfig
from tests.support.fake_backends import Fakes, Knobs, truth, wait_until

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88]
WAN_TIMEOUT_S = 1.0
# Path policy: P->MD when the WAN estimate fits 1e9 ms, P->RLD->MD when it must fit 0 ms.
P_MD_POLICY = PathPolicyConfig(max_wan_transfer_ms=1e9, enable_outlier_filter=False)
P_RLD_MD_POLICY = PathPolicyConfig(max_wan_transfer_ms=0.0, enable_outlier_filter=False)
# So slow a link that MD's estimate (all cached) picks P->MD and its exact answer (0 cached)
# P->RLD->MD after registering first.
SLOW_WAN = PathPolicyConfig(wan_gbps=1e-6, wan_rtt_ms=0.0, kv_bytes_per_token=100, page_size=1,
                            max_wan_transfer_ms=1000.0, enable_outlier_filter=False)
WAN_PEER = "127.0.0.1:1"  # the MainBackend's wan_peer in scenario(): nothing listens there


def flow_config(policy: PathPolicyConfig = P_RLD_MD_POLICY, mode: Optional[HandoffMode] = HandoffMode.ONE_SHOT,
                threshold: int = 64) -> FlowConfig:
    return FlowConfig(path=policy, handoff=HandoffConfig(catch_up_threshold_tokens=threshold, fixed_mode=mode),
                      wan_timeout_s=WAN_TIMEOUT_S, rld_max_running=16)


@dataclasses.dataclass
class Run:
    fakes: Fakes
    flow: Optional[PddFlow] = None
    emitted: list = dataclasses.field(default_factory=list)
    chunks: list = dataclasses.field(default_factory=list)
    error: Optional[BaseException] = None
    tasks_after: Optional[set] = None
    first_chunk_t: Optional[float] = None  # time.monotonic(), the clock of the fakes' records
    last_chunk_t: Optional[float] = None
    ended_t: Optional[float] = None  # when events() returned: the client's reply was complete
    lingering_at_end: int = 0  # tasks the flow left behind (router/flow/lingering.py)
    lingering_cancelled: int = 0  # ... still running 5 s after the end

    @property
    def fallbacks(self) -> list[str]:
        return [f.reason.value + (":" + f.detail if f.reason is Reason.RECOVERED_ON_RELAY else "")
                for f in self.flow.result.fallbacks]


def scenario(knobs: Knobs, max_new: int = 30, cfg: Optional[FlowConfig] = None, control_url: Optional[str] = None,
             force_path: Optional[Path] = None, gates=None, timeout_s: float = 20.0, p_control: bool = False,
             p_control_url: Optional[str] = None, md_estimate: int = 0, sampling: Optional[dict] = None,
             extras: Optional[dict] = None, rid: Optional[str] = "req", control_key: Optional[bytes] = None,
             fakes_control_key: Optional[bytes] = None) -> Run:
    """Runs one request through PddFlow against fresh fakes. ``gates(run)`` may set hooks on
    ``knobs`` that read ``run.flow`` (the fakes share the flow's event loop). ``p_control``:
    P has its control API (late WAN destinations) at the fake's URL, or at ``p_control_url``;
    ``md_estimate``: the router's estimate of MD's cached prefix; ``control_key``: the router
    signs its control calls with it (``--control-key-file``); ``fakes_control_key``: the fakes
    sign their control replies with it."""

    async def main() -> Run:
        fakes = await Fakes(knobs, control_key=fakes_control_key).start()
        run = Run(fakes)
        if gates is not None:
            gates(run)
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        try:
            main_backend = MainBackend(fakes.md_url, control_url or fakes.md_url, WAN_PEER)
            prefill = PrefillBackend(fakes.p_url, 8998,
                                     control_url=(p_control_url or fakes.p_control_url) if p_control else None)
            req = FlowRequest(PROMPT, {"max_new_tokens": max_new, "temperature": 0.0, **(sampling or {})},
                              extras=extras, rid=rid)
            pick = ServerPick(prefill, fakes.rld_url, main_backend, force_path=force_path, md_cached_estimate=md_estimate)
            lingering = Lingering()
            run.flow = PddFlow(req, pick, cfg or flow_config(), FlowShared(session, lingering=lingering))
            try:
                async for tokens in run.flow.events():
                    run.last_chunk_t = time.monotonic()
                    if run.first_chunk_t is None:
                        run.first_chunk_t = run.last_chunk_t
                    run.chunks.append(list(tokens))
                    run.emitted.extend(tokens)
            except BackendError as e:
                run.error = e
            run.ended_t = time.monotonic()
            run.tasks_after = set(run.flow.tasks)
            run.lingering_at_end = len(lingering)
            run.lingering_cancelled = await lingering.settle(5.0)
            # Aborts and releases are sent by then; the fakes' streams wind down right after.
            await wait_until(lambda: fakes.rld_active == 0 and fakes.md_active == 0, timeout_s=5)
        finally:
            await session.close()
            await fakes.stop()
        return run

    if control_key is not None:  # else the router's signer stays as the test left it
        use_control_key(control_key)
    try:
        return asyncio.run(asyncio.wait_for(main(), timeout_s))
    finally:
        if control_key is not None:
            use_control_key(None)


def assert_invariants(run: Run, max_new: int, complete: bool = True) -> None:
    want = truth(PROMPT, max_new)
    if complete:
        assert run.error is None, run.error
        assert run.emitted == want
    else:
        assert run.emitted == want[:len(run.emitted)]
    assert all(run.chunks), "empty chunk yielded"
    assert not run.tasks_after, f"tasks left after events(): {run.tasks_after}"
    assert run.lingering_cancelled == 0, "work left by the request did not land within 5 s"
    fakes = run.fakes
    registered = fakes.registered_rooms() if fakes.knobs.md_register == "ok" else []
    for room in registered:
        assert fakes.released_rooms().count(room) == 1, (room, fakes.released_rooms())
    assert set(fakes.released_rooms()) <= set(registered)
    assert fakes.rld_active == 0 and fakes.md_active == 0
    r = run.flow.result
    assert r.rld_tokens + r.md_tokens == len(run.emitted)


def assert_handed_off(run: Run, max_new: int) -> dict:
    """MD took over: one final handoff with all eager tokens, RLD's leg aborted."""
    fakes, r = run.fakes, run.flow.result
    finals = fakes.records("md", "handoff")
    assert len(finals) == 1
    final = finals[0].body
    cut = r.handoff_at
    assert cut is not None and final["token_ids"] == truth(PROMPT, cut)
    assert final["sampling_params"]["max_new_tokens"] == max_new  # the total budget (resume contract)
    assert "custom_params" not in final["sampling_params"]
    assert r.md_tokens == max_new - cut and r.rld_tokens == cut
    assert leg_rid(run, "r1") in fakes.aborted_rids("rld")
    assert fakes.rld_aborted[leg_rid(run, "r1")].is_set()
    return final


def leg_rid(run: Run, leg: str) -> str:
    """The internal rid the flow gave one of its backend requests (never the client's)."""
    return f"{run.flow.internal_rid}-{leg}"


def emitted_at_least(run: Run, n: int):
    async def gate(room):
        await wait_until(lambda: len(run.flow.stitcher.emitted) >= n)
    return gate


def takeover(knobs: Knobs, ready_after: int):
    """Gates: MD's KV lands once RLD has emitted ``ready_after`` tokens, and MD's last token
    waits for RLD's abort and the room's release, which must come on MD's first token (not
    from the end-of-request cleanup)."""

    def gates(run: Run) -> None:
        knobs.md_before_ready = emitted_at_least(run, ready_after)

        async def last_token(i, budget):
            if i == budget - 1:
                await wait_until(lambda: leg_rid(run, "r1") in run.fakes.aborted_rids("rld") and run.fakes.released_rooms(),
                                 timeout_s=5)
        knobs.md_before_token = last_token
    return gates


def p_md_cfg() -> FlowConfig:
    return flow_config(policy=P_MD_POLICY)


def t_of(run: Run, server: str, kind: str, index: int = 0) -> float:
    records = run.fakes.records(server, kind)
    assert len(records) > index, f"no {server} {kind} record #{index}"
    return records[index].t


def p_leg_params(run: Run) -> dict:
    gens = run.fakes.records("p", "generate")
    assert gens, "P got no request"
    return gens[0].body["sampling_params"].get("custom_params") or {}


def assert_p_control_sane(run: Run) -> None:
    """At most one destination or one drop per room, never a destination after a drop."""
    posted = [r.body["bootstrap_room"] for r in run.fakes.records("p", "destination")]
    dropped = run.fakes.dropped_rooms()
    assert len(posted) == len(set(posted)) and len(dropped) == len(set(dropped)), (posted, dropped)
    for room in set(posted) & set(dropped):
        assert t_of(run, "p", "destination") < t_of(run, "p", "drop"), "destination posted after its drop"
