"""The PDD router's HTTP front (aiohttp): SGLang-native /generate over P, RLD and MD pools.

I/O only: per request a ``PddFlow`` (router/flow.py) runs the legs; path and handoff
decisions come from the pure policy modules. Also serves /health and Prometheus /metrics.

    python -m sglang_pdd.router --tokenizer-path MODEL \\
        --prefill http://P:30000,8998[,http://P:31000] --relay http://RLD:30001 \\
        --main http://MD:30002,http://MD:31002,WAN_HOST:WAN_PORT
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import time
from dataclasses import asdict
from typing import Optional

import aiohttp
from aiohttp import web

from sglang_pdd.handoff.policy import HandoffConfig, HandoffMode
from sglang_pdd.router.backends import BackendError
from sglang_pdd.router.flow import FlowConfig, MainBackend, PddFlow, PrefillBackend
from sglang_pdd.router.metrics import CONTENT_TYPE, RouterMetrics
from sglang_pdd.router.placement import InstanceLoad, pick_instance
from sglang_pdd.router.policy import Path, PathPolicyConfig
from sglang_pdd.router.prefix_index import PrefixIndex

logger = logging.getLogger("sglang_pdd.router")

MAX_BODY_BYTES = 64 * 1024 * 1024


class Pools:
    """Backend pools and what the router knows of them: in-flight counts and cached prefixes."""

    def __init__(self, prefill: list[PrefillBackend], relay: list[str], main: list[MainBackend],
                 index_blocks_per_instance: int = 1 << 16):
        if not prefill or not relay:
            raise ValueError("the router needs at least one --prefill and one --relay server")
        self.prefill, self.relay, self.main = prefill, relay, main
        self._rr = itertools.count()
        self.rld_inflight = {url: 0 for url in relay}
        self.md_inflight = {m.url: 0 for m in main}
        # Approximate prefix index (16-token blocks): P's hit estimate and MD session affinity.
        self.prefixes = PrefixIndex(index_blocks_per_instance, block_tokens=16)

    def pick(self, input_ids: list[int]) -> tuple[PrefillBackend, str, Optional[MainBackend]]:
        prefill = self.prefill[next(self._rr) % len(self.prefill)]
        relay = min(self.relay, key=lambda url: self.rld_inflight[url])  # least loaded RLD
        main = None
        if self.main:
            # Least loaded first: among MDs holding equally long prefixes (e.g. a shared system
            # prompt) the tie goes to the idlest, not always to the first configured one.
            by_load = sorted(self.main, key=lambda m: self.md_inflight[m.url])
            owner, matched = self.prefixes.best([m.url for m in by_load], input_ids)
            loads = [InstanceLoad(m.url, self.md_inflight[m.url]) for m in self.main]
            # Stay with the MD holding the session's prefix unless it has 4+ more requests in flight.
            chosen = pick_instance(loads, owner if matched else None, max_affinity_excess=4)
            main = next(m for m in self.main if m.url == chosen)
        return prefill, relay, main

    def record(self, flow: PddFlow, output_ids: list[int]) -> None:
        """After a request: P holds its prompt; the MD that decoded it holds prompt + output."""
        self.prefixes.record(flow.prefill.url, flow.ids)
        if flow.main is not None and flow.result.md_tokens:
            self.prefixes.record(flow.main.url, flow.ids + output_ids)


class RequestError(ValueError):
    """The client's request is malformed; answered with HTTP 400 and a clear message."""


# SGLang's HTTP server drops a keep-alive connection after 5 idle seconds
# (SGLANG_TIMEOUT_KEEP_ALIVE). Reusing one just as it does fails the request with "Server
# disconnected" (seen in CI: a P leg sent 5 s after the previous one), so the router retires
# idle connections well before the server can.
BACKEND_KEEPALIVE_S = 2.0


def backend_session(keepalive_s: float = BACKEND_KEEPALIVE_S) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=keepalive_s),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))


class Router:
    def __init__(self, pools: Pools, flow_cfg: FlowConfig, tokenizer, max_prompt_tokens: int,
                 served_model: str):
        self.pools, self.flow_cfg, self.tokenizer = pools, flow_cfg, tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.served_model = served_model
        self.metrics = RouterMetrics()
        self.session: Optional[aiohttp.ClientSession] = None

    async def start(self, app):
        self.session = backend_session()

    async def close(self, app):
        await self.session.close()

    # ------------------------------------------------------------------ routes
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "prefill": len(self.pools.prefill),
                                  "relay": len(self.pools.relay), "main": len(self.pools.main)})

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._json_body(request)
            input_ids = self._input_ids(body)
            sampling = body.get("sampling_params") or {}
            if not isinstance(sampling, dict):
                raise RequestError("sampling_params must be an object")
            flow = self._flow(input_ids, sampling, body.get("rid"), body.get("pdd_options"))
        except RequestError as e:
            return web.json_response({"error": str(e)}, status=400)
        if body.get("stream"):
            return await self._stream(request, flow)
        return await self._once(flow)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """OpenAI /v1/completions (text prompt, non-streaming and streaming)."""
        try:
            body = await self._json_body(request)
            if body.get("model") not in (None, self.served_model):
                return web.json_response({"error": {"message": f"unknown model {body.get('model')!r}; "
                                                    f"this router serves {self.served_model!r}",
                                                    "type": "invalid_request_error"}}, status=404)
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise RequestError("prompt must be a string")
            input_ids = self._check_len(self.tokenizer.encode(prompt))
            sampling = {"max_new_tokens": int(body.get("max_tokens", 16)),
                        "temperature": float(body.get("temperature", 1.0))}
        except (RequestError, TypeError, ValueError) as e:
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error"}}, status=400)
        flow = self._flow(input_ids, sampling, None)
        tokens, error = await self._collect(flow)
        if error:
            return web.json_response({"error": {"message": error, "type": "server_error"}}, status=502)
        finish = (flow.result.finish_reason or {}).get("type", "length")
        return web.json_response({
            "id": f"cmpl-{flow.result.rid}", "object": "text_completion", "created": int(time.time()),
            "model": self.served_model,
            "choices": [{"index": 0, "text": self.tokenizer.decode(tokens), "finish_reason": finish}],
            "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(tokens),
                      "total_tokens": len(input_ids) + len(tokens)}})

    # ------------------------------------------------------------------ helpers
    async def _json_body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("body must be a JSON object")
        return body

    def _input_ids(self, body: dict) -> list[int]:
        if "input_ids" in body:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise RequestError("input_ids must be a non-empty list of non-negative ints")
            return self._check_len(ids)
        if isinstance(body.get("text"), str) and body["text"]:
            return self._check_len(self.tokenizer.encode(body["text"]))
        raise RequestError("body needs a non-empty 'text' or 'input_ids' (batches are not supported)")

    def _check_len(self, ids: list[int]) -> list[int]:
        if len(ids) > self.max_prompt_tokens:
            raise RequestError(f"prompt has {len(ids)} tokens, more than --max-prompt-tokens "
                               f"{self.max_prompt_tokens}")
        return ids

    def _flow(self, input_ids, sampling, rid, options: Optional[dict] = None) -> PddFlow:
        """``options`` (body "pdd_options") override the router's knobs for one request:
        path (p_md / p_rld_md / p_rld_only), handoff_mode, catch_up_threshold, drc (false:
        MD ignores its cache, i.e. plain cross-DC PD that ships the whole prompt). For tests,
        benchmarks comparing variants side by side, and operators debugging one request."""
        cfg, force_path = self.flow_cfg, None
        if options is not None:
            if not isinstance(options, dict) or set(options) - {"path", "handoff_mode", "catch_up_threshold", "drc"}:
                raise RequestError("pdd_options may set only path, handoff_mode, catch_up_threshold, drc")
            try:
                force_path = Path(options["path"]) if "path" in options else None
                handoff = dataclasses.replace(
                    cfg.handoff,
                    fixed_mode=HandoffMode(options["handoff_mode"]) if "handoff_mode" in options else cfg.handoff.fixed_mode,
                    catch_up_threshold_tokens=int(options.get("catch_up_threshold", cfg.handoff.catch_up_threshold_tokens)))
            except ValueError as e:
                raise RequestError(f"bad pdd_options: {e}") from None
            cfg = dataclasses.replace(cfg, handoff=handoff)
        prefill, relay, main = self.pools.pick(input_ids)
        # The MD prefix estimate routes a request whose P takes late WAN destinations
        # without waiting for MD's registration (PddFlow); MD's exact answer is reported too.
        md_estimate = self.pools.prefixes.match(main.url, input_ids) if main is not None else 0
        flow = PddFlow(self.session, cfg, prefill, relay, main, input_ids, sampling, rid,
                       rld_inflight=self.pools.rld_inflight[relay], force_path=force_path,
                       use_drc=bool((options or {}).get("drc", True)), md_cached_estimate=md_estimate)
        flow.result.p_cached_estimate = self.pools.prefixes.match(prefill.url, input_ids)
        return flow

    async def _collect(self, flow: PddFlow) -> tuple[list[int], Optional[str]]:
        tokens, error = [], None
        self._admit(flow, +1)
        events = flow.events()
        try:
            async for new in events:
                tokens.extend(new)
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            error = str(e)
            logger.error("rid %s failed: %s", flow.result.rid, e)
        finally:
            await events.aclose()  # runs the flow's cleanup now, not whenever the GC gets to it
            self._admit(flow, -1)
            self._observe(flow, tokens)
        return tokens, error

    def _admit(self, flow: PddFlow, delta: int) -> None:
        self.pools.rld_inflight[flow.relay_url] += delta
        if flow.main is not None:
            self.pools.md_inflight[flow.main.url] += delta

    async def _once(self, flow: PddFlow) -> web.Response:
        tokens, error = await self._collect(flow)
        if error:
            return web.json_response({"error": error, "meta_info": self._meta(flow, tokens)}, status=502)
        return web.json_response({"text": self.tokenizer.decode(tokens), "output_ids": tokens,
                                  "meta_info": self._meta(flow, tokens)})

    async def _stream(self, request: web.Request, flow: PddFlow) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        tokens: list[int] = []
        self._admit(flow, +1)
        events = flow.events()
        try:
            async for new in events:
                tokens.extend(new)
                event = {"text": self.tokenizer.decode(tokens), "output_ids": list(tokens),
                         "meta_info": self._meta(flow, tokens, final=False)}
                await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            final = {"text": self.tokenizer.decode(tokens), "output_ids": tokens,
                     "meta_info": self._meta(flow, tokens)}
            await out.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.metrics.client_disconnect()  # flow.events()' finally aborted every backend leg
            raise
        except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            logger.error("rid %s failed mid-stream: %s", flow.result.rid, e)
            await out.write(b"data: " + json.dumps({"error": str(e)}).encode() + b"\n\ndata: [DONE]\n\n")
        finally:
            await events.aclose()  # a disconnect aborts every backend leg before we return
            self._admit(flow, -1)
            self._observe(flow, tokens)
        await out.write_eof()
        return out

    def _meta(self, flow: PddFlow, tokens: list[int], final: bool = True) -> dict:
        r = flow.result
        return {"id": r.rid, "prompt_tokens": r.prompt_tokens, "completion_tokens": len(tokens),
                "finish_reason": r.finish_reason if final else None, "cached_tokens": r.md_cached_tokens,
                "pdd": asdict(r)}

    def _observe(self, flow: PddFlow, tokens: list[int]) -> None:
        self.pools.record(flow, tokens)
        n_tokens = len(tokens)
        r = flow.result
        e2e = time.perf_counter() - flow.t0
        # One structured line per request: what happened to it, keyed by its id.
        logger.info("request %s", json.dumps({
            "rid": r.rid, "path": r.path, "prompt_tokens": r.prompt_tokens, "output_tokens": n_tokens,
            "md_cached": r.md_cached_tokens, "md_cached_est": r.md_cached_estimate,
            "md_registration": r.md_registration, "p_cached": r.p_cached_tokens, "handoff_at": r.handoff_at,
            "mode": r.handoff_mode, "stall_s": r.handoff_stall_s, "ttft_s": r.ttft_s, "e2e_s": round(e2e, 4),
            "rld_tokens": r.rld_tokens, "md_tokens": r.md_tokens, "fallbacks": r.fallbacks}))
        tpot = (e2e - r.ttft_s) / (n_tokens - 1) if r.ttft_s is not None and n_tokens > 1 else None
        try:
            self.metrics.observe_request(r.path or "p_rld_only", ttft_s=r.ttft_s, tpot_s=tpot, e2e_s=e2e,
                                         prompt_tokens=r.prompt_tokens, md_cached_tokens=r.md_cached_tokens,
                                         p_cached_tokens=min(r.p_cached_tokens, r.prompt_tokens),
                                         rld_output_tokens=r.rld_tokens, md_output_tokens=r.md_tokens)
            if r.wan_bytes is not None:
                self.metrics.wan_transfer(r.wan_bytes, r.wan_bytes_saved)
            if r.handoff_mode and r.handoff_at is not None:
                self.metrics.observe_handoff(r.handoff_mode, r.handoff_stall_s, r.handoff_payload_bytes or 0)
            for fb in r.fallbacks:
                reason = fb.split(":", 1)[0]
                if reason in ("wan_failed",):
                    self.metrics.transfer_failed()
                self.metrics.fallback(_FALLBACK_LABELS.get(reason, "md_failed"))
        except ValueError as e:  # metrics must never break serving
            logger.warning("metrics: %s", e)


# Flow fallback tags -> the closed label set of pdd:fallbacks_total.
_FALLBACK_LABELS = {"wan_failed": "wan_failed", "md_failed": "md_failed", "md_unavailable": "md_failed",
                    "recovered_on_relay": "md_failed",
                    "wan_destination_failed": "wan_failed"}  # P refused the late WAN destination


def build_app(router: Router) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.close)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_route)
    app.router.add_post("/generate", router.generate)
    app.router.add_post("/v1/completions", router.completions)
    return app


def _prefill_arg(value: str) -> PrefillBackend:
    """URL,BOOTSTRAP_PORT or URL,BOOTSTRAP_PORT,CONTROL_URL (P's --pdd-control-listen)."""
    from urllib.parse import urlparse

    head, _, last = value.rpartition(",")
    control = None
    if not last.isdigit():  # a third field: P's control API
        control, (head, _, last) = last, head.rpartition(",")
        if urlparse(control).scheme not in ("http", "https") or not urlparse(control).hostname:
            raise argparse.ArgumentTypeError(f"--prefill must be URL,BOOTSTRAP_PORT[,CONTROL_URL] with an "
                                             f"http(s) CONTROL_URL, got {value!r}")
    if not head or not last.isdigit():
        raise argparse.ArgumentTypeError(f"--prefill must be URL,BOOTSTRAP_PORT[,CONTROL_URL], got {value!r}")
    return PrefillBackend(head, int(last), urlparse(head).hostname or "127.0.0.1", control_url=control)


def _main_arg(value: str) -> MainBackend:
    parts = value.split(",")
    if len(parts) != 3 or ":" not in parts[2]:
        raise argparse.ArgumentTypeError(f"--main must be URL,CONTROL_URL,WAN_HOST:WAN_PORT, got {value!r}")
    return MainBackend(*parts)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sglang_pdd.router",
                                 description="PDD router: P, RLD and MD pools behind one /generate.")
    ap.add_argument("--prefill", type=_prefill_arg, action="append", required=True,
                    help="URL,BOOTSTRAP_PORT[,CONTROL_URL] of a prefill server (repeatable); CONTROL_URL is "
                         "P's --pdd-control-listen: then P->RLD->MD requests start P and RLD without "
                         "waiting for MD's room registration (one WAN round trip off the TTFT)")
    ap.add_argument("--relay", action="append", required=True, help="URL of a relay decode server (repeatable)")
    ap.add_argument("--main", type=_main_arg, action="append", default=[],
                    help="URL,CONTROL_URL,WAN_ADDR of a main decode server; WAN_ADDR is what P dials (repeatable)")
    ap.add_argument("--tokenizer-path", required=True, help="tokenizer of the served model")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30300)
    ap.add_argument("--max-prompt-tokens", type=int, default=32768)
    ap.add_argument("--control-key-file", default=None,
                    help="the servers' --pdd-wan-key-file: the router signs its calls to MD's and P's control "
                         "APIs with it (they refuse unsigned ones); required with --main or a P CONTROL_URL")
    g = ap.add_argument_group("path policy (uncached tokens and estimated WAN transfer time)")
    g.add_argument("--wan-gbps", type=float, default=10.0, help="WAN link rate used to estimate transfer time")
    g.add_argument("--wan-rtt-ms", type=float, default=40.0)
    g.add_argument("--kv-bytes-per-token", type=int, default=46_000)
    g.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    g.add_argument("--max-wan-transfer-ms", type=float, default=None,
                   help="P->MD when the uncached suffix crosses the WAN within this; default: 25%% of the TTFT SLO")
    g.add_argument("--page-size", type=int, default=1, help="KV page size of P and MD (whole-page hits)")
    g.add_argument("--outlier-min-input-tokens", type=int, default=32_768)
    g.add_argument("--outlier-max-output-tokens", type=int, default=16)
    g.add_argument("--disable-outlier-filter", action="store_true")
    g.add_argument("--wan-timeout-s", type=float, default=30.0,
                   help="MD's KV not landed by then: RLD finishes the request")
    ap.add_argument("--request-timeout-s", type=float, default=600.0,
                    help="a request still running after this fails with a clear error; all its legs are aborted")
    h = ap.add_argument_group("handoff")
    h.add_argument("--handoff-mode", choices=["auto", "one_shot", "catch_up"], default="auto",
                   help="auto follows RLD load (one-shot when busy, catch-up when idle)")
    h.add_argument("--catch-up-threshold", type=int, default=64, help="max tokens per catch-up batch")
    h.add_argument("--rld-max-running", type=int, default=16, help="RLD capacity, for its load estimate")
    return ap.parse_args(argv)


def flow_config(args) -> FlowConfig:
    return FlowConfig(
        path=PathPolicyConfig(wan_gbps=args.wan_gbps, wan_rtt_ms=args.wan_rtt_ms,
                              kv_bytes_per_token=args.kv_bytes_per_token, ttft_slo_ms=args.ttft_slo_ms,
                              max_wan_transfer_ms=args.max_wan_transfer_ms, page_size=args.page_size,
                              enable_outlier_filter=not args.disable_outlier_filter,
                              outlier_min_input_tokens=args.outlier_min_input_tokens,
                              outlier_max_output_tokens=args.outlier_max_output_tokens),
        handoff=HandoffConfig(catch_up_threshold_tokens=args.catch_up_threshold,
                              fixed_mode=None if args.handoff_mode == "auto" else HandoffMode(args.handoff_mode)),
        wan_timeout_s=args.wan_timeout_s, rld_max_running=args.rld_max_running,
        request_timeout_s=args.request_timeout_s)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from transformers import AutoTokenizer

    from sglang_pdd.kv_channel.handshake import load_key
    from sglang_pdd.router.backends import use_control_key

    if args.control_key_file:
        try:
            use_control_key(load_key(args.control_key_file))
        except ValueError as e:  # KeyFileError: names the file, its mode or length
            raise SystemExit(f"sglang_pdd.router: error: --control-key-file: {e}") from None
    elif args.main or any(p.control_url for p in args.prefill):
        raise SystemExit("sglang_pdd.router: error: --control-key-file is required with --main or a P CONTROL_URL "
                         "(MD and P accept only signed control calls)")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
    router = Router(Pools(args.prefill, args.relay, args.main), flow_config(args), tokenizer,
                    args.max_prompt_tokens, args.served_model_name or args.tokenizer_path)
    web.run_app(build_app(router), host=args.host, port=args.port, print=None, handler_cancellation=True)
