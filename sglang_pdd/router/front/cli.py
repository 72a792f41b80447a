"""The router's command line: ``python -m sglang_pdd.router`` (flags, the flow settings they
make, the serving layer's SGLang flags, the operator token) and the process it starts: one
router serving the HTTP app (router/front/app.py), or several workers on one port
(router/front/workers.py).

    python -m sglang_pdd.router --tokenizer-path MODEL \\
        --prefill http://P:30000,8998[,http://P:31000] --relay http://RLD:30001 \\
        --main http://MD:30002,http://MD:31002,WAN_HOST:WAN_PORT
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from typing import Optional

from aiohttp import web

from sglang_pdd.handoff.policy import HandoffConfig, HandoffMode
from sglang_pdd.kv_channel.handshake import KeyFileError, open_private
from sglang_pdd.router.backends.stall import RelayStallBounds
from sglang_pdd.router.front.overload import OverloadLimits
from sglang_pdd.router.front import client_auth
from sglang_pdd.router.backends import control_tls
from sglang_pdd.router.front import discovery_setup
from sglang_pdd.router.front import shared_drain
from sglang_pdd.router.front.app import MAX_BODY_BYTES, Router, build_app
from sglang_pdd.router.flow.pdd_flow import FlowConfig
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.router.backends.health import HealthConfig
from sglang_pdd.router.policy import RLD_MAX_RUNNING_DEFAULT, PathMode, PathPolicyConfig
from sglang_pdd.router.backends.placement import MD_FLOW_STEP_S_DEFAULT, MdMoveCost
from sglang_pdd.router.backends.pools import Pools
from sglang_pdd.router.front.validate import LogprobLimits

logger = logging.getLogger("sglang_pdd.router")


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


def build_parser() -> argparse.ArgumentParser:
    """The router's whole command line (docs/flags.md is generated from it)."""
    ap = argparse.ArgumentParser(prog="python -m sglang_pdd.router",
                                 description="PDD router: P, RLD and MD pools behind one /generate.")
    ap.add_argument("--prefill", type=_prefill_arg, action="append", default=[],
                    metavar="URL,BOOTSTRAP_PORT[,CONTROL_URL]",
                    help="a prefill server (repeatable); CONTROL_URL is P's --pdd-control-listen: then a "
                         "P->RLD->MD request is routed on the router's estimate of MD's prefix, P and RLD start "
                         "at once and MD's room is registered concurrently (one WAN round trip off the TTFT); "
                         "without it the router registers on MD first")
    ap.add_argument("--relay", action="append", default=[], metavar="URL",
                    help="a relay decode server (repeatable)")
    ap.add_argument("--main", type=_main_arg, action="append", default=[], metavar="URL,CONTROL_URL,WAN_ADDR",
                    help="a main decode server (repeatable); CONTROL_URL is its --pdd-control-listen, WAN_ADDR "
                         "(HOST:PORT) its --pdd-wan-listen as P dials it (in P's --pdd-wan-peers)")
    ap.add_argument("--tokenizer-path", required=True, metavar="PATH", help="tokenizer of the served model")
    ap.add_argument("--served-model-name", default=None, metavar="NAME",
                    help="model name in the API; default: --tokenizer-path")
    ap.add_argument("--host", default="127.0.0.1", metavar="HOST", help="address the router's client port binds")
    ap.add_argument("--port", type=int, default=30300, help="the router's client port")
    ap.add_argument("--workers", type=int, default=1,
                    help="router processes serving --port (SO_REUSEPORT); each keeps its own prefix index, "
                         "in-flight counts and metrics (docs/router.md); secrets reach them in their "
                         "environment, never on their argv, and operator drains are shared among them")
    ap.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set on each worker
    ap.add_argument("--max-prompt-tokens", type=int, default=32768, help="longest prompt in tokens (400 above)")
    ap.add_argument("--max-md-tp", type=int, default=8,
                    help="the largest TP size an MD may report at registration (P dials one WAN port per MD "
                         "rank); a larger one is a failed registration and the request stays on RLD")
    ap.add_argument("--control-key-file", default=None, metavar="PATH",
                    help="the servers' --pdd-wan-key-file: the router signs its calls to MD's and P's control "
                         "APIs with it (they refuse unsigned ones) and checks their signed replies (a bad one "
                         "is an MD/P failure: RLD serves); required with --main or a P CONTROL_URL")
    lim = ap.add_argument_group("client input limits and operator access (docs/api.md)")
    lim.add_argument("--max-new-tokens-cap", type=int, default=32768,
                     help="largest max_new_tokens / max_tokens a client may ask for (400 above)")
    lim.add_argument("--max-n", type=int, default=16, help="largest parallel sample count n")
    lim.add_argument("--max-flows-per-request", type=int, default=64,
                     help="most generations one request may ask for, batch items x n (each runs on P, RLD and MD); "
                          "also the most prompts of a /v1/tokenize list")
    lim.add_argument("--max-grammar-bytes", type=int, default=16384,
                     help="largest json_schema / regex / ebnf / structural_tag (P, RLD and MD each compile it)")
    lim.add_argument("--max-top-logprobs-num", type=int, default=LogprobLimits.max_top_logprobs_num,
                     help="largest top_logprobs_num (top_logprobs / logprobs in the OpenAI API); 400 above")
    lim.add_argument("--max-token-ids-logprob", type=int, default=LogprobLimits.max_token_ids_logprob,
                     help="most token ids in token_ids_logprob; 400 above")
    lim.add_argument("--max-logprob-stream-entries", type=int, default=LogprobLimits.max_stream_logprob_entries,
                     help="most logprob entries one return_logprob request's stream may carry in all (SGLang's "
                          "events are cumulative: ~max_new_tokens^2 / 2 x (1 + top_logprobs_num + "
                          "len(token_ids_logprob)), docs/security.md); 400 above")
    lim.add_argument("--max-prompt-chars", type=int, default=None,
                     help="longest prompt text, checked before tokenizing; default: 16 x --max-prompt-tokens")
    lim.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="request body limit (413 above)")
    lim.add_argument("--operator-token-file", default=None, metavar="PATH",
                     help="file (mode 0600) holding the operator token: requests with header "
                          "X-PDD-Operator-Token equal to it may send pdd_options (path, handoff_mode, "
                          "catch_up_threshold, drc), get meta_info.pdd, /flush_cache, abort_all")
    lim.add_argument("--every-client-is-operator", action="store_true",
                     help="tests and benchmarks only: every request is an operator request")
    lim.add_argument("--enable-cache-report", action="store_true",
                     help="report P's prefix hit as meta_info.cached_tokens / usage cached tokens "
                          "(off: 0, so a tenant cannot probe another's prompts through the cache)")
    sg = ap.add_argument_group("SGLang serving layer (chat template, parsers), as on a plain SGLang server")
    for flag, kind in (("--chat-template", None), ("--completion-template", None), ("--tool-call-parser", None),
                       ("--reasoning-parser", None), ("--context-length", int)):
        sg.add_argument(flag, type=kind, default=None, help=f"as SGLang's {flag}")
    sg.add_argument("--sglang-args", default="", metavar="ARGS",
                    help="further SGLang server flags for the serving layer, one shell-quoted string")
    g = ap.add_argument_group("path policy (uncached tokens and estimated WAN transfer time)")
    g.add_argument("--wan-gbps", type=float, default=10.0, help="WAN link rate used to estimate transfer time")
    g.add_argument("--wan-rtt-ms", type=float, default=40.0,
                   help="WAN round trip used in the estimate: P->MD pays every one-way trip of its messages")
    g.add_argument("--kv-bytes-per-token", type=int, default=46_000,
                   help="KV size for the WAN estimate until MD reports its own (its stats, asked at start, "
                        "and each registration answer; a sliding-window MD reports its window too)")
    g.add_argument("--ttft-slo-ms", type=float, default=2000.0,
                   help="TTFT target: P->MD when P's queue + prefill + the WAN fit a share of what it leaves "
                        "after a safety share (--path-mode)")
    g.add_argument("--path-mode", choices=[m.value for m in PathMode], default=PathMode.FIT.value,
                   help="how RLD's load sets P->MD's share of the TTFT slack: fit = --p-md-share-idle while RLD "
                        "idles, the whole slack when it is busy (high-hit requests P->MD, RLD for the low-hit "
                        "rest); relay_first = 0 while RLD idles (an idle RLD takes every request)")
    g.add_argument("--p-md-share-idle", type=float, default=PathPolicyConfig.p_md_share_idle,
                   help="fit mode: the share of the TTFT slack P->MD may use while RLD idles")
    g.add_argument("--p-prefill-tokens-per-s", type=float, default=None,
                   help="P's prefill speed, to count P's queue and the request's prefill (the router's tokens "
                        "in flight on P) against the TTFT budget; unset: measured from each P's /v1/loads "
                        f"(SGLang's prefill counters), {PathPolicyConfig.p_prefill_tokens_per_s:g} until P has "
                        "prefilled enough to say")
    g.add_argument("--p-md-registers-first", action="store_true",
                   help="P->MD registers the request on MD (a WAN round trip) before P starts and decides again "
                        "on MD's exact prefix; default: P starts at once and MD registers beside it, as for "
                        "P->RLD->MD (a P without a control API always registers first)")
    g.add_argument("--md-side-after-first-token", action="store_true",
                   help="P->RLD->MD registers on MD and gives P its WAN destination once the client has its "
                        "first token, keeping that work (the router's, MD's, P's WAN copy) out of the first "
                        "token's way on busy hosts; MD's KV then lands that much later. Default: beside P and "
                        "RLD's legs (needs P's control API either way)")
    g.add_argument("--p-prefill-s-per-token-ctx", type=float, default=PathPolicyConfig.p_prefill_s_per_token_ctx,
                   help="P's attention term: seconds per new token per context token (the simulator's "
                        "prefill_s_per_token_ctx for the model and chip); 0: a linear prefill estimate")
    g.add_argument("--gap-slo-ms", type=float, default=1000.0,
                   help="longest gap between tokens the users should see: P->MD's WAN wait falls between its "
                        "first token (through RLD) and MD's first, so the path rule caps its budget (the TTFT "
                        "slack's share, less P's queue, prefill and the registration) at this; 0: no cap, "
                        "the TTFT rule alone")
    g.add_argument("--md-flow-step-ms", type=float, default=MD_FLOW_STEP_S_DEFAULT * 1e3,
                   help="MD's decode step growth per request in flight, until the router measures it from MD's "
                        "/v1/loads: a turn leaves the MD holding its prefix only when the busier MD's longer "
                        "steps cost it more than re-sending the prefix over the WAN (router/backends/placement.py)")
    g.add_argument("--max-wan-transfer-ms", type=float, default=None,
                   help="fixed WAN budget: P->MD when the uncached suffix crosses the WAN within this, else "
                        "P->RLD->MD. Default: the budget follows RLD's load and --path-mode "
                        "(router/policy.py: p_md_wan_budget_ms)")
    g.add_argument("--page-size", type=int, default=PathPolicyConfig.page_size,
                   help="KV page size of P and MD (whole-page hits)")
    g.add_argument("--outlier-min-input-tokens", type=int, default=32_768,
                   help="outlier filter: a prompt this long or longer whose max_new_tokens is at most "
                        "--outlier-max-output-tokens stays on P->RLD (MD never sees it)")
    g.add_argument("--outlier-max-output-tokens", type=int, default=16, help="see --outlier-min-input-tokens")
    g.add_argument("--disable-outlier-filter", action="store_true", help="turn the outlier filter off")
    g.add_argument("--wan-timeout-s", type=float, default=30.0,
                   help="MD's KV not landed by then: RLD finishes the request")
    g.add_argument("--md-stall-timeout-s", type=float, default=20.0,
                   help="no new token on MD's stream this long after a handoff (the WAN down, MD stopped; "
                        "bytes that carry no token do not count): MD failed, the request goes on from what the "
                        "client has on a new P->RLD leg (0: wait as long as TCP does)")
    g.add_argument("--md-first-token-timeout-s", type=float, default=FlowConfig.md_first_token_timeout_s,
                   help="MD's first token after the final handoff not in this long (the client waits for it "
                        "while RLD's tokens are held back; MD has one extend pass to run): MD failed, and the "
                        "request goes on from RLD as for --md-stall-timeout-s (0: only that bounds the wait)")
    g.add_argument("--relay-stall-timeout-s", type=float, default=FlowConfig.relay_stall_timeout_s,
                   help="no new token on a relay leg's stream this long after its first, while RLD made no "
                        "progress on any stream the router reads (a stopped RLD, not a busy one): the leg "
                        "stalled; MD goes on where a handoff is under way or its KV is coming, else the "
                        "request ends with what the client has and a clear error (0: no bound)")
    g.add_argument("--relay-first-token-timeout-s", type=float, default=FlowConfig.relay_first_token_timeout_s,
                   help="the same for a relay leg's first token (P's queue and prefill, the KV transfer, RLD's "
                        "queue), while RLD, and P until it replied to the leg, made no progress: the request "
                        "is retried elsewhere once or fails with 502 (0: no bound)")
    ap.add_argument("--request-timeout-s", type=float, default=600.0,
                    help="a request still running after this fails with a clear error; all its legs are aborted")
    h = ap.add_argument_group("handoff")
    h.add_argument("--handoff-mode", choices=["auto", "one_shot", "catch_up"], default="auto",
                   help="auto follows RLD load (one-shot when busy, catch-up when idle)")
    h.add_argument("--catch-up-threshold", type=int, default=64, help="max tokens per catch-up batch")
    h.add_argument("--rld-max-running", type=int, default=RLD_MAX_RUNNING_DEFAULT,
                   help="requests in flight at which the router counts an RLD as full, for the load-aware "
                        "WAN budget and the handoff mode (default %(default)s, about half an 8-GPU RLD's batch "
                        "cap, from the simulator's sweep: scale it with a smaller RLD; docs/sim-notebook.md)")
    hc = ap.add_argument_group("backend health (docs/router.md)")
    hc.add_argument("--health-check-interval-s", type=float, default=10.0,
                    help="GET /health on every backend this often (SGLang's /health decodes one token; "
                         "0: passive checks only)")
    hc.add_argument("--breaker-failures", type=int, default=3,
                    help="consecutive failures (requests or probes) that take a backend or P-RLD pair out")
    hc.add_argument("--breaker-cooldown-s", type=float, default=10.0,
                    help="how long a backend stays out before it gets a trial request again")
    ov = ap.add_argument_group("overload (router/front/overload.py)")
    ov.add_argument("--max-inflight-per-relay", type=int, default=0,
                    help="requests one relay decode server may hold (every request holds one until it ends); "
                         "past it on the least loaded one, 503 with Retry-After at once. 0: 4x its "
                         "--max-running-requests, read from its /v1/loads (no cap until it answers)")
    ov.add_argument("--max-inflight-total", type=int, default=0,
                    help="requests the router may hold in all (503 with Retry-After past it); 0: the sum of the "
                         "relay decode servers' caps. With --workers each worker counts its own")
    client_auth.add_args(ap)  # --api-key, --ssl-*, --backend-api-key, --backend-ca-file
    control_tls.add_args(ap)  # --control-tls-*
    discovery_setup.add_args(ap)  # --service-discovery, --*-selector, --main-discovery-*
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def flow_config(args) -> FlowConfig:
    return FlowConfig(
        path=PathPolicyConfig(wan_gbps=args.wan_gbps, wan_rtt_ms=args.wan_rtt_ms,
                              kv_bytes_per_token=args.kv_bytes_per_token, ttft_slo_ms=args.ttft_slo_ms,
                              mode=PathMode(args.path_mode), p_md_share_idle=args.p_md_share_idle,
                              p_prefill_tokens_per_s=args.p_prefill_tokens_per_s or PathPolicyConfig.p_prefill_tokens_per_s,
                              p_prefill_s_per_token_ctx=args.p_prefill_s_per_token_ctx,
                              first_token_via_rld=True, gap_slo_ms=args.gap_slo_ms or None,
                              p_md_registers_first=args.p_md_registers_first,
                              max_wan_transfer_ms=args.max_wan_transfer_ms, page_size=args.page_size,
                              enable_outlier_filter=not args.disable_outlier_filter,
                              outlier_min_input_tokens=args.outlier_min_input_tokens,
                              outlier_max_output_tokens=args.outlier_max_output_tokens),
        handoff=HandoffConfig(catch_up_threshold_tokens=args.catch_up_threshold,
                              fixed_mode=None if args.handoff_mode == "auto" else HandoffMode(args.handoff_mode)),
        wan_timeout_s=args.wan_timeout_s, rld_max_running=args.rld_max_running,
        request_timeout_s=args.request_timeout_s, md_stall_timeout_s=args.md_stall_timeout_s,
        md_first_token_timeout_s=args.md_first_token_timeout_s,
        relay_stall_timeout_s=args.relay_stall_timeout_s, relay_first_token_timeout_s=args.relay_first_token_timeout_s,
        md_side_after_first_token=args.md_side_after_first_token)


def sglang_argv(args) -> list[str]:
    """SGLang server flags for the router's serving layer (tokenizer, templates, parsers)."""
    argv = ["--model-path", args.tokenizer_path, "--device", "cpu"]
    for flag, value in (("--served-model-name", args.served_model_name), ("--chat-template", args.chat_template),
                        ("--completion-template", args.completion_template),
                        ("--tool-call-parser", args.tool_call_parser), ("--reasoning-parser", args.reasoning_parser),
                        ("--context-length", args.context_length)):
        if value is not None:
            argv += [flag, str(value)]
    if args.enable_cache_report:
        argv.append("--enable-cache-report")
    return argv + shlex.split(args.sglang_args)


def read_operator_token(path: Optional[str]) -> Optional[str]:
    """The token in ``path``, refused (SystemExit naming the file) when group or others may
    access the file, as the key files are: anyone who reads it may steer PDD and flush caches."""
    if path is None:
        return None
    try:
        fd = open_private(path)
    except KeyFileError as e:
        raise SystemExit(f"--operator-token-file: {e}") from None
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        token = f.read(1 << 16).strip()
    if len(token) < 16:
        raise SystemExit(f"--operator-token-file {path}: the token must have at least 16 characters")
    return token


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.workers < 1:
        raise SystemExit("sglang_pdd.router: error: --workers must be at least 1")
    wrong = discovery_setup.check_args(args)
    if wrong:
        raise SystemExit(f"sglang_pdd.router: error: {wrong}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for warning in client_auth.resolve_secrets(args):  # key files read; a worker's from its environment
        logger.warning(warning)
    if args.workers > 1:
        from sglang_pdd.router.front.workers import run_workers

        raise SystemExit(run_workers(args.workers, args.host, args.port, sys.argv[1:] if argv is None else argv,
                                     client_auth.secrets_for_workers(args)))
    from sglang_pdd.router.front.serving import build_sglang_state

    client_ssl = client_auth.ssl_context(args)  # before the slow start: bad TLS flags fail at once
    client_auth.use_backend_api_key(args.backend_api_key)
    client_auth.use_backend_ca(args.backend_ca_file)

    from sglang_pdd.kv_channel.handshake import load_key
    from sglang_pdd.router.backends.clients import set_max_md_tp, use_control_key, use_control_tls

    control_urls = [p.control_url for p in args.prefill if p.control_url] + [m.control_url for m in args.main]
    use_control_tls(control_tls.control_client_context(args, control_urls))

    try:
        set_max_md_tp(args.max_md_tp)
    except ValueError as e:
        raise SystemExit(f"sglang_pdd.router: error: {e}") from None

    if args.control_key_file:
        try:
            use_control_key(load_key(args.control_key_file))
        except ValueError as e:  # KeyFileError: names the file, its mode or length
            raise SystemExit(f"sglang_pdd.router: error: --control-key-file: {e}") from None
    elif args.main or any(p.control_url for p in args.prefill) or discovery_setup.may_find_main(args):
        raise SystemExit("sglang_pdd.router: error: --control-key-file is required with --main, a P CONTROL_URL, "
                         "--main-selector or --main-discovery-file (MD and P accept only signed control calls)")
    state = build_sglang_state(sglang_argv(args))
    if args.every_client_is_operator:
        logger.warning("--every-client-is-operator: any client may steer PDD (pdd_options); tests only")
    try:
        health = HealthConfig(failure_threshold=args.breaker_failures, cooldown_s=args.breaker_cooldown_s)
    except ValueError as e:
        raise SystemExit(f"sglang_pdd.router: error: --breaker-failures / --breaker-cooldown-s: {e}") from None
    md_move = MdMoveCost(kv_bytes_per_token=args.kv_bytes_per_token, wan_bytes_per_s=args.wan_gbps * 1e9 / 8,
                         flow_step_s=args.md_flow_step_ms / 1e3)
    try:
        RelayStallBounds(args.relay_stall_timeout_s, args.relay_first_token_timeout_s)
    except ValueError as e:
        raise SystemExit(f"sglang_pdd.router: error: --relay-stall-timeout-s / --relay-first-token-timeout-s: {e}") from None
    try:
        shed = OverloadLimits(per_relay=args.max_inflight_per_relay or None, total=args.max_inflight_total or None)
    except ValueError as e:
        raise SystemExit(f"sglang_pdd.router: error: --max-inflight-per-relay / --max-inflight-total: {e}") from None
    pools = Pools(args.prefill, args.relay, args.main, health=health, md_move=md_move,
                  allow_empty=args.service_discovery)  # discovery fills them
    router = Router(pools, flow_config(args), state[2],
                    args.max_prompt_tokens, args.served_model_name or args.tokenizer_path, sglang_state=state,
                    max_new_tokens_cap=args.max_new_tokens_cap, max_n=args.max_n,
                    operator_token=read_operator_token(args.operator_token_file),
                    every_client_is_operator=args.every_client_is_operator,
                    report_cached_tokens=args.enable_cache_report, max_prompt_chars=args.max_prompt_chars,
                    max_flows_per_request=args.max_flows_per_request, max_grammar_bytes=args.max_grammar_bytes,
                    logprob_limits=LogprobLimits(args.max_top_logprobs_num, args.max_token_ids_logprob,
                                                  args.max_logprob_stream_entries),
                    health_check_interval_s=args.health_check_interval_s, shared_drains=shared_drain.from_env(),
                    measure_prefill=args.p_prefill_tokens_per_s is None, overload=shed)
    app = build_app(router, args.max_body_bytes)
    discovery = discovery_setup.build(args, router)
    if discovery is not None:  # after the router's own start: the membership uses its session
        app.on_startup.append(discovery.start)
        app.on_cleanup.insert(0, discovery.close)
    web.run_app(client_auth.install(app, args.api_key), host=args.host,
                port=args.port, print=None, handler_cancellation=True, reuse_port=args.reuse_port or None,
                ssl_context=client_ssl)
