"""The router's flows: open one for a settled request (pick its servers, apply its operator
options), run it (load on each backend, metrics, the request's log line), retry one that broke
before its first token.

SGLang's serving layer (router/front/serving.py) and the router's own /health_generate use it; the
HTTP front (router/front/app.py) builds it beside them, so the serving layer never calls back into
the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from typing import Optional, Sequence

import aiohttp

from sglang_pdd.handoff.policy import HandoffMode
from sglang_pdd.router.backends.clients import BackendError
from sglang_pdd.router.flow.fallback import Fallback, Reason
from sglang_pdd.router.flow.lingering import Lingering
from sglang_pdd.router.flow.pdd_flow import FlowConfig, PddFlow
from sglang_pdd.router.flow.pick import FlowShared, ServerPick
from sglang_pdd.router.flow.request import FlowRequest
from sglang_pdd.router.front.metrics import RouterMetrics
from sglang_pdd.router.policy import Path
from sglang_pdd.router.backends.health import BackendFailed, BackendSucceeded
from sglang_pdd.router.backends.pools import NoBackend, Pools
from sglang_pdd.router.backends.stall import BackendProgress
from sglang_pdd.router.front.serving import BackendsUnavailable, UpstreamError
from sglang_pdd.router.front import overload
from sglang_pdd.router.front.overload import OverloadLimits
from sglang_pdd.log_text import client_text

logger = logging.getLogger("sglang_pdd.router")


class PrefillLoad:
    """P's load of one flow: the prefill tokens P still runs for it (backends/placement.py's
    pick_prefill), counted from the flow's start until P's leg replies, or the flow ends first;
    released once."""

    def __init__(self, pools: Pools, url: str, tokens: int, ids: Sequence[int]):
        self.pools, self.url, self.tokens, self.ids = pools, url, tokens, ids
        self.counted = False

    def count(self) -> None:
        self.pools.count_on_p(self.url, self.tokens)
        self.counted = True

    def release(self) -> None:
        if self.counted:
            self.counted = False
            self.pools.prefill_replied(self.url, self.tokens, self.ids)


class FlowRunner:
    """``session``: the router's client session to its backends (set when the router starts)."""

    def __init__(self, pools: Pools, flow_cfg: FlowConfig, metrics: RouterMetrics,
                 overload: OverloadLimits = OverloadLimits()):
        self.pools, self.flow_cfg, self.metrics = pools, flow_cfg, metrics
        self.session: Optional[aiohttp.ClientSession] = None
        self.overload = overload
        self.relay_slots: dict[str, Optional[int]] = {url: None for url in pools.relay}  # from their /v1/loads
        self.progress = BackendProgress()  # when each server last made progress (the relay stall guard's)
        self.lingering = Lingering()  # work flows leave behind when they end

    def open(self, req: FlowRequest, exclude: frozenset = frozenset(), with_main: bool = True,
             retry_of: Optional[PddFlow] = None) -> PddFlow:
        """A flow for ``req`` on servers picked now (none of ``exclude``); BackendsUnavailable
        when no server of a needed role may take it. ``with_main`` False: on P and RLD only,
        MD not asked at all (the router's own probe, /health_generate). ``retry_of``: the flow
        this one starts over for, on other servers than ``exclude`` (its fallbacks come first).

        ``req.options`` (body "pdd_options", operators only) override the router's knobs for
        one request: path (p_md / p_rld_md / p_rld_only), handoff_mode, catch_up_threshold, drc
        (false: MD ignores its cache, i.e. plain cross-DC PD that ships the whole prompt). For
        tests, benchmarks comparing variants side by side, and operators debugging one request."""
        cfg, force_path, options = self.flow_cfg, None, req.options
        if options is not None:
            force_path = Path(options["path"]) if "path" in options else None
            handoff = dataclasses.replace(
                cfg.handoff,
                fixed_mode=HandoffMode(options["handoff_mode"]) if "handoff_mode" in options else cfg.handoff.fixed_mode,
                catch_up_threshold_tokens=int(options.get("catch_up_threshold", cfg.handoff.catch_up_threshold_tokens)))
            cfg = dataclasses.replace(cfg, handoff=handoff)
        try:
            prefill, relay, main = self.pools.pick(req.input_ids, exclude=exclude, max_new_tokens=req.max_new_tokens)
        except NoBackend as e:
            raise BackendsUnavailable(str(e)) from None
        why = overload.refusal(self.overload, relay, self.pools.rld_inflight, self.relay_slots)
        if why is not None:  # at once, nothing started: the client retries, the cluster drains
            self.metrics.overload_refused()
            raise BackendsUnavailable(why, self.overload.retry_after_s)
        if not with_main:
            main = None
        if prefill.prefill_tokens_per_s and prefill.prefill_tokens_per_s != cfg.path.p_prefill_tokens_per_s:
            cfg = dataclasses.replace(cfg, path=dataclasses.replace(cfg.path, p_prefill_tokens_per_s=prefill.prefill_tokens_per_s))
        # The MD prefix estimate routes a request whose P takes late WAN destinations
        # without waiting for MD's registration (PddFlow); MD's exact answer is reported too.
        md_estimate = self.pools.prefixes.match(main.url, req.input_ids) if main is not None else 0
        p_estimate = self.pools.prefixes.match(prefill.url, req.input_ids)
        fallbacks = []
        if retry_of is not None:
            fallbacks += [*retry_of.result.fallbacks, Fallback(Reason.RETRIED_ELSEWHERE, ", ".join(sorted(exclude)))]
        if main is None and self.pools.main and with_main:
            fallbacks.append(Fallback(Reason.MD_UNAVAILABLE, "every MD is failing or draining"))
        pick = ServerPick(prefill, relay, main, rld_inflight=self.pools.rld_inflight[relay],
                      p_queued_tokens=self.pools.p_tokens[prefill.url], md_cached_estimate=md_estimate,
                      p_cached_estimate=p_estimate,
                      md_kv_size=self.pools.md_kv_sizes.get(main.url) if main is not None else None,
                      force_path=force_path, use_drc=bool((options or {}).get("drc", True)),
                      fallbacks=tuple(fallbacks), retry=retry_of is not None,
                      p_load=PrefillLoad(self.pools, prefill.url, max(1, len(req.input_ids) - p_estimate), req.input_ids))
        return PddFlow(req, pick, cfg, FlowShared(self.session, self.pools.wan, self.pools.learn_md_kv_size,
                                                  self.progress, self.lingering))

    def retry(self, failed: PddFlow) -> Optional[PddFlow]:
        """A request whose P or RLD leg broke before its first token starts over once, on
        other servers (the failed ones' breakers counted the failure): None when it was
        already a retry, failed elsewhere, or nothing else may take it."""
        if failed.pick.retry:
            return None
        bad = frozenset(key[-1] for key in failed.result.failed_backends if key[0] in ("prefill", "relay", "pair"))
        if not bad:
            return None
        try:
            flow = self.open(failed.request, exclude=bad, retry_of=failed)
        except BackendsUnavailable:
            return None
        logger.warning("rid %s failed before its first token on %s; retried on other servers",
                       client_text(failed.result.rid), sorted(bad))
        return flow

    @contextlib.asynccontextmanager
    async def run(self, flow: PddFlow):
        """Accounts for one running flow (load, metrics, log line); a backend failure becomes
        UpstreamError (HTTP 502); the flow's cleanup (abort every leg) runs on any exit."""
        self.admit(flow, +1)
        events = flow.events()
        try:
            yield events
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            logger.error("rid %s failed: %s", client_text(flow.result.rid), e)
            raise UpstreamError(f"the request failed on a backend: {e}") from None
        except (ConnectionResetError, asyncio.CancelledError):
            self.metrics.client_disconnect()
            raise
        finally:
            await events.aclose()  # runs the flow's cleanup now, not whenever the GC gets to it
            self.admit(flow, -1)
            self.observe(flow, list(flow.stitcher.emitted))

    def running(self) -> int:
        """Flows running now (each holds a relay slot until it ends)."""
        return sum(self.pools.rld_inflight.values())

    def admit(self, flow: PddFlow, delta: int) -> None:
        """A flow starts (+1) or ends (-1): its load on its backends."""
        if flow.p_load is not None and delta > 0:
            flow.p_load.count()
        elif flow.p_load is not None:
            flow.p_load.release()
        self.pools.rld_inflight[flow.relay_url] += delta
        if flow.main is not None:
            self.pools.md_inflight[flow.main.url] += delta

    def observe(self, flow: PddFlow, tokens: list[int]) -> None:
        """A flow ended having emitted ``tokens``: placement, health, its log line, metrics."""
        record_prefixes(self.pools, flow, tokens)
        record_health(self.pools, flow, time.monotonic())
        n_tokens = len(tokens)
        r = flow.result
        e2e = time.perf_counter() - flow.t0
        # One structured line per request: what happened to it, keyed by its id.
        logger.info("request %s", json.dumps({
            "rid": r.rid, "path": r.path, "prompt_tokens": r.prompt_tokens, "output_tokens": n_tokens,
            "md_cached": r.md_cached_tokens, "md_cached_est": r.md_cached_estimate,
            "md_registration": r.md_registration, "p_cached": r.p_cached_tokens, "handoff_at": r.handoff_at,
            "mode": r.handoff_mode, "stall_s": r.handoff_stall_s, "ttft_s": r.ttft_s, "e2e_s": round(e2e, 4),
            "rld_tokens": r.rld_tokens, "md_tokens": r.md_tokens, "reason": r.reason, "marks": r.marks,
            "fallbacks": [str(f) for f in r.fallbacks]}))
        try:
            self.metrics.observe_flow(r, e2e, n_tokens, flow.main.url if flow.main is not None else None)
        except ValueError as e:  # metrics must never break serving
            logger.warning("metrics: %s", e)


def record_health(pools: Pools, flow: PddFlow, now: float) -> None:
    """A finished flow's outcome on the board: each backend a leg broke on fails; a request
    that completed is a success for every server and pair it used (closes a half-open
    breaker). A client gone or a timeout is neither."""
    failed = set(map(tuple, flow.result.failed_backends))
    for key in failed:
        pools.health.record(key, BackendFailed(now, "a request failed on it"))
    if not flow.completed:
        return
    used = [("prefill", flow.prefill.url), ("relay", flow.relay_url), ("pair", flow.prefill.url, flow.relay_url)]
    if flow.main is not None and (flow.result.md_tokens or flow.result.wan_ready_s is not None):
        used.append(("main", flow.main.url))
    for key in used:
        if key not in failed:
            pools.health.record(key, BackendSucceeded(now))

def record_prefixes(pools: Pools, flow: PddFlow, output_ids: list[int]) -> None:
    """After a request: P holds its prompt; the MD that decoded it holds prompt + output; an
    MD its KV landed on (or is landing on, released with keep_kv) holds the prompt."""
    pools.prefixes.record(flow.prefill.url, flow.ids)
    if flow.main is None:
        return
    if flow.result.md_tokens:
        pools.prefixes.record(flow.main.url, flow.ids + output_ids)
    elif flow.result.wan_bytes is not None or flow.result.md_kv_kept:
        pools.prefixes.record(flow.main.url, flow.ids)
