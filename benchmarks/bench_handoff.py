"""Handoff-overhead microbenchmark, on real SGLang servers and the emulated WAN.

One ``LocalCluster`` (P + RLD in datacenter A, MD in datacenter B, the WAN emulator, the
router) and, side by side in the same run:

(a) token-ID handoff + MD extend. Per room: register the prompt at MD, make P send its KV
    over the WAN (the PD request to P and RLD from the router's builders, router/flow/bodies.py), wait
    until MD's room is ready, then POST the E eager tokens (the real greedy continuation,
    from a reference generation) to MD's handoff API *through an emulated WAN link* (a
    second emulator in front of MD's control port: the router sits in datacenter A).
    Payload = the JSON body (what pdd_flow.py sends; msgpack for reference) and the bytes that
    crossed the emulated link (HTTP headers included). Latency = send -> MD's first
    continuation token (= MD's stall) and -> full response.
(b) incremental KV: the same E tokens' KV (decode_prefix_len = prompt, num_tokens = prompt
    + E) through WanKvSender -> WanEmulator -> WanKvReceiver, timed from begin_transfer to
    the receiver's SUCCESS; once with the tiny model's KV over the cluster's (scaled) link,
    once with the reference design's 46 KB/token over the unscaled link it stands for.
    (b) needs no extend pass at MD (zero compute in the timing), but MD still has to run
    one decode step and send the token back (>= one more one-way latency) before the
    client sees it; that is *not* in (b)'s number, so (b)'s real stall is higher.

TTFT: for each WAN latency, streaming requests through the router with path p_rld_md,
p_md and p_rld_only, plus a same-DC PD reference (P -> RLD directly, no router, no MD).
For p_md the router serves token 1 from RLD (RLD's budget is one token), so the table
also shows "first MD token": the TTFT that plain cross-DC PD (P -> MD) would have. Two
router placements, measured side by side: ``ctl=local`` (the cluster as launched: router <-> MD
control on loopback), ``ctl=wan`` (a second router whose MD control traffic crosses an
emulated link with the same latency: the realistic placement, router in datacenter A; it
registers the room on MD while P and RLD already run, posting the WAN destination to P's
control API) and ``ctl=wan_serial`` (the same placement, but the router waits for MD's
registration before starting P and RLD: what a P without a control API gets).

The WAN rate is "1 Gbps-equivalent": the tiny model's KV is 512 B/token against ~46 KB/token
in the reference design, so the KV link is slowed by that ratio (KV transfer *times* match
a 1 Gbps link with the real model); token-ID traffic (control link) runs at the unscaled
rate since its size does not depend on the model.

    .venv/bin/python -m benchmarks.bench_handoff                 # 3-10 min on 2 cores, with their load
    .venv/bin/python -m benchmarks.bench_handoff --n 5 --ttft-requests 1 --latencies-ms 5,200   # quick look, 3-5 min

Writes results.json and bench_handoff.png under --out (default artifacts/bench_handoff/).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import http.client
import json
import logging
import os
import platform
import random
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np
from tqdm import tqdm

from sglang_pdd.launcher.http import get_json, post_json, signed_headers
from sglang_pdd.protocol import ReadyReply, RegisterReply, RegisterRequest
from sglang_pdd.protocol import routes as api
from sglang_pdd.router.backends.clients import SSE_DONE, parse_sse_line
from sglang_pdd.router.flow.bodies import handoff_body, pd_leg_body, wan_destination_params

BENCH_ROUTER_ARGS = ["--every-client-is-operator"]  # pdd_options are operator-only

REF_KV_BYTES_PER_TOKEN = 46_000  # the reference design's figure (router default --kv-bytes-per-token)
REF_NUM_LAYERS = 40  # only shapes the chunking of the synthetic reference KV (40 x 1150 B/page)
REAL_VOCAB = 128_256  # a real tokenizer's size, for the "real ids" payload estimate
KEY = b"bench-handoff-key-0123456789abcdef"

# ---------------------------------------------------------------------------- pure helpers


def summarize(values: Iterable[float]) -> dict:
    """n, mean, p50, p90, p99, max, min, std (sample std, 0 for n < 2); empty -> n=0 only."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return {"n": 0}
    return {"n": int(v.size), "mean": float(v.mean()), "p50": float(np.percentile(v, 50)),
            "p90": float(np.percentile(v, 90)), "p99": float(np.percentile(v, 99)),
            "max": float(v.max()), "min": float(v.min()),
            "std": float(v.std(ddof=1)) if v.size > 1 else 0.0}


def scaled_rate_gbps(equiv_gbps: float, kv_bytes_per_token: int,
                     ref_kv_bytes_per_token: int = REF_KV_BYTES_PER_TOKEN) -> float:
    """Link rate at which the tiny model's KV takes as long as the reference model's at equiv_gbps."""
    if kv_bytes_per_token <= 0 or ref_kv_bytes_per_token <= 0:
        raise ValueError("KV bytes per token must be positive")
    return equiv_gbps * kv_bytes_per_token / ref_kv_bytes_per_token


def handoff_message(eager: Sequence[int], rid: str, continuation_tokens: int,
                    sampling: Optional[dict] = None) -> dict:
    """MD's final handoff of ``eager`` tokens for ``continuation_tokens`` more, built by the
    router's own builder (its max_new_tokens is the whole budget, eager tokens included)."""
    return handoff_body(list(eager), rid,
                        {**(sampling or {}), "max_new_tokens": len(eager) + continuation_tokens}).to_json()


def payload_sizes(body: dict) -> dict:
    """Encoded sizes of one handoff message: JSON as pdd_flow.py counts it, compact JSON, msgpack."""
    import msgpack

    return {"json": len(json.dumps(body)), "json_compact": len(json.dumps(body, separators=(",", ":"))),
            "msgpack": len(msgpack.packb(body))}


def ideal_transfer_s(nbytes: int, rate_gbps: float, latency_ms: float) -> float:
    """One-way latency + serialization at line rate: what a faithful link needs to deliver nbytes."""
    return latency_ms / 1e3 + nbytes * 8 / (rate_gbps * 1e9)


def parse_csv_floats(text: str) -> list[float]:
    out = [float(x) for x in text.split(",") if x.strip()]
    if not out:
        raise ValueError(f"no values in {text!r}")
    return out


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------- HTTP


def delete(url: str, key: Optional[bytes] = None) -> None:
    req = urllib.request.Request(url, method="DELETE", headers=signed_headers("DELETE", url, b"", key))
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
    except OSError:
        pass


def sse_post(url: str, body: dict, timeout: float = 120.0,
             key: Optional[bytes] = None) -> Iterator[tuple[float, dict]]:
    """POST and yield (perf_counter at arrival, event) for each SSE ``data:`` object."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = json.dumps(body).encode()
        conn.request("POST", u.path, body=data,
                     headers={"Content-Type": "application/json", **signed_headers("POST", url, data, key)})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{url} -> HTTP {resp.status}: {resp.read()[:300]!r}")
        while True:
            line = resp.readline()
            if not line:
                return
            event = parse_sse_line(line, url)
            if event is SSE_DONE:
                return
            if event is not None:
                yield time.perf_counter(), event
    finally:
        conn.close()


# ---------------------------------------------------------------------------- setup


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]  # 0-2: bos / eos / pad


class Bench:
    def __init__(self, args, cluster, ctl_emu_url: str, ctl_wan_url: str, router_wan_url: str, vocab: int,
                 router_wan_serial_url: Optional[str] = None):
        self.args, self.cluster, self.vocab = args, cluster, vocab
        topo = cluster.topology
        self.p, self.rld, self.md = topo.prefill, topo.relay, topo.main
        self.control = topo.main.control_url  # direct (loopback): untimed registration / ready / release
        self.key = cluster.control_key  # MD's control API takes signed calls only
        self.ctl_wan_url = ctl_wan_url  # MD's control API through the emulated link
        self.ctl_emu_url = ctl_emu_url  # that emulator's own control endpoint
        self.routers = {"local": topo.router_url, "wan": router_wan_url, "wan_serial": router_wan_serial_url}
        self.wan_peer = f"127.0.0.1:{topo.wan.listen_port}"
        self.rng = random.Random(args.seed)
        self.greedy = {"temperature": 0.0, "ignore_eos": True}

    def set_latency(self, latency_ms: float) -> None:
        self.cluster.wan_control("link", latency_ms=latency_ms)
        get_json(f"{self.ctl_emu_url}/link?latency_ms={latency_ms}")

    def pd_bodies(self, ids: list[int], room: int, max_new: int, md_room: Optional[int] = None,
                  md_cached: int = 0, rid: str = "") -> dict:
        """The router's P/RLD leg (with the WAN fan-out when md_room), from its own builders."""
        sampling = {**self.greedy, "max_new_tokens": max_new}
        if md_room is not None:
            sampling["custom_params"] = wan_destination_params(md_room, self.wan_peer, md_cached)
        return pd_leg_body(ids, sampling, rid or f"bench-{room:x}", "127.0.0.1", self.p.bootstrap_port, room)

    # ------------------------------------------------------------------ (a)
    def references(self, prompts: list[list[int]], n_tokens: int) -> list[list[int]]:
        """Greedy continuations via the router (P -> RLD), all at once (RLD batches them)."""
        def one(ids):
            body = {"input_ids": ids, "sampling_params": {**self.greedy, "max_new_tokens": n_tokens},
                    "pdd_options": {"path": "p_rld_only"}}
            return post_json(f"{self.routers['local']}/generate", body, timeout=600)["output_ids"]

        with cf.ThreadPoolExecutor(16) as pool:
            return list(tqdm(pool.map(one, prompts), total=len(prompts), desc="(a) reference generations",
                             file=sys.stderr))

    def token_handoff(self, ids: list[int], ref: list[int]) -> dict:
        a, E, K = self.args, self.args.eager_tokens, self.args.continuation_tokens
        room = random.getrandbits(63)
        reg = RegisterReply.from_json(post_json(f"{self.control}{api.MD_REGISTER.path()}",
                                                RegisterRequest(room, ids).to_json(), key=self.key))
        body = self.pd_bodies(ids, room, 1, md_room=room, md_cached=reg.cached_tokens)
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(2) as pool:
            legs = [pool.submit(post_json, f"{self.p.url}/generate", body),
                    pool.submit(post_json, f"{self.rld.url}/generate", body)]
            ready = ReadyReply.from_json(get_json(f"{self.control}{api.ready_target(room, 60)}", timeout=90,
                                                  key=self.key))
            t_ready = time.perf_counter() - t0
            for f in legs:
                f.result()
        if ready.status != "ready":
            delete(f"{self.control}{api.MD_RELEASE.path(room=room)}", self.key)
            raise RuntimeError(f"room {room} not ready: {ready}")
        eager = ref[:E]
        msg = handoff_message(eager, f"bench-{room:x}-m", K, self.greedy)
        up0 = get_json(f"{self.ctl_emu_url}/stats")["bytes_up"]
        t_first = None
        out: list[int] = []
        meta: dict = {}
        t_send = time.perf_counter()
        for t, event in sse_post(f"{self.ctl_wan_url}{api.MD_HANDOFF.path(room=room)}", msg, key=self.key):
            if len(event.get("output_ids") or []) > E and t_first is None:  # MD streams from position 0
                t_first = t
            out = event.get("output_ids") or out
            meta = event.get("meta_info") or meta
        t_done = time.perf_counter()
        wire_up = get_json(f"{self.ctl_emu_url}/stats")["bytes_up"] - up0
        delete(f"{self.control}{api.MD_RELEASE.path(room=room)}", self.key)
        return {"room": room, "prompt_tokens": len(ids), "kv_bytes_per_token": reg.kv_bytes_per_token,
                "prompt_kv_ready_s": t_ready, **{f"payload_{k}": v for k, v in payload_sizes(msg).items()},
                "wire_bytes_up": wire_up, "stall_s": (t_first - t_send) if t_first else None,
                "total_s": t_done - t_send, "md_cached_tokens": meta.get("cached_tokens"),
                "md_output_tokens": len(out) - E, "matches_reference": out == ref[:E + K]}

    # ------------------------------------------------------------------ (b)
    def kv_transfers(self, kv_bytes_per_token: int, num_layers: int, rate_gbps: float, latency_ms: float,
                     jitter_ms: float, prompt_tokens: int, n: int, desc: str) -> dict:
        from sglang_pdd.kv_channel.layout import KvLayout
        from sglang_pdd.kv_channel.contract import RoomState
        from sglang_pdd.launcher.wan_emulator import WanEmulator
        from sglang_pdd.kv_channel.wan_receiver import WanKvReceiver
        from sglang_pdd.kv_channel.wan_sender import WanKvSender

        E = self.args.eager_tokens
        if kv_bytes_per_token % num_layers:
            raise ValueError(f"{kv_bytes_per_token} B/token is not a multiple of {num_layers} layers")
        layout = KvLayout(num_layers, 1, kv_bytes_per_token // num_layers, "bfloat16")
        total = prompt_tokens + E
        kv = np.random.default_rng(0).integers(0, 256, (num_layers, total, layout.bytes_per_page), dtype=np.uint8)
        rx = WanKvReceiver(KEY, name="bench-md", idle_timeout=30)
        emu = WanEmulator(rx.address, rate_gbps=rate_gbps, latency_ms=latency_ms, jitter_ms=jitter_ms).start()
        tx = WanKvSender(emu.address, KEY, name="bench-p", idle_timeout=30, transfer_timeout=120)
        landed, acked, wire = [], [], []
        try:
            if not tx.connect(10):
                raise RuntimeError("KV sender could not connect through the emulator")
            for room in tqdm(range(1, n + 1), desc=desc, file=sys.stderr):
                dest = np.zeros_like(kv)
                rx.register_room(room, layout, total, dest, decode_prefix_len=prompt_tokens)
                up0 = emu.stats()["bytes_up"]
                t0 = time.perf_counter()
                xfer = tx.begin_transfer(room, layout, total, prompt_tokens)
                xfer.send_kv(kv)
                state = rx.wait(room, 120)
                t_land = time.perf_counter()
                sent = xfer.wait(120)
                t_ack = time.perf_counter()
                if state != RoomState.SUCCESS or sent != RoomState.SUCCESS:
                    raise RuntimeError(f"KV transfer failed: {xfer.failure_reason} {xfer.failure_detail}")
                if not np.array_equal(dest[:, prompt_tokens:], kv[:, prompt_tokens:]):
                    raise RuntimeError("KV transfer delivered wrong bytes")
                landed.append(t_land - t0)
                acked.append(t_ack - t0)
                wire.append(emu.stats()["bytes_up"] - up0)
                rx.release_room(room)
                tx.release(room)
        finally:
            tx.close()
            emu.stop()
            rx.close()
        return {"kv_bytes_per_token": kv_bytes_per_token, "payload_bytes": E * kv_bytes_per_token,
                "ideal_landed_s": ideal_transfer_s(E * kv_bytes_per_token, rate_gbps, latency_ms),
                "wire_bytes_up_mean": float(np.mean(wire)), "rate_gbps": rate_gbps, "latency_ms": latency_ms,
                "landed_s": landed, "acked_s": acked}

    # ------------------------------------------------------------------ TTFT
    def route_stream(self, router: str, ids: list[int], path: str) -> dict:
        body = {"input_ids": ids, "stream": True, "pdd_options": {"path": path, "handoff_mode": "one_shot"},
                "sampling_params": {**self.greedy, "max_new_tokens": self.args.ttft_max_new}}
        t0 = time.perf_counter()
        ttft = first_md = None
        meta: dict = {}
        n = 0
        for t, event in sse_post(f"{router}/generate", body, timeout=self.args.request_timeout_s):
            n = len(event.get("output_ids") or []) or n
            meta = event.get("meta_info") or meta
            if ttft is None and event.get("output_ids"):
                ttft = t - t0
            if first_md is None and (meta.get("pdd") or {}).get("md_tokens"):
                first_md = t - t0
        pdd = meta.get("pdd") or {}
        return {"ttft_s": ttft, "first_md_token_s": first_md, "e2e_s": time.perf_counter() - t0, "tokens": n,
                "handoff_at": pdd.get("handoff_at"), "handoff_stall_s": pdd.get("handoff_stall_s"),
                "handoff_payload_bytes": pdd.get("handoff_payload_bytes"), "fallbacks": pdd.get("fallbacks"),
                "path": pdd.get("path"), "router_ttft_s": pdd.get("ttft_s")}

    def same_dc_pd(self, ids: list[int]) -> dict:
        """Plain PD inside datacenter A: P -> RLD (Mooncake), no router, no MD."""
        room = random.getrandbits(63)
        body = self.pd_bodies(ids, room, self.args.ttft_max_new, rid=f"bench-sdc-{room:x}")
        with cf.ThreadPoolExecutor(1) as pool:
            t0 = time.perf_counter()
            p = pool.submit(post_json, f"{self.p.url}/generate", body)
            ttft = None
            for t, event in sse_post(f"{self.rld.url}/generate", {**body, "stream": True}, timeout=self.args.request_timeout_s):
                if ttft is None and event.get("output_ids"):
                    ttft = t - t0
            e2e = time.perf_counter() - t0
            p.result(timeout=self.args.request_timeout_s)
        return {"ttft_s": ttft, "first_md_token_s": None, "e2e_s": e2e, "path": "same_dc_pd"}


# ---------------------------------------------------------------------------- report


def ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def print_table(headers: list[str], rows: list[list], file=sys.stdout) -> None:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    print(line, file=file)
    print("-" * len(line), file=file)
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), file=file)


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    ho = results["handoff"]
    series = [("(a) token IDs\n+ MD extend\n(to 1st token)", ho["a"]["stall_s"]),
              ("(b) KV, tiny model\nscaled link", ho["b_tiny"]["landed_s"]),
              (f"(b) KV, {REF_KV_BYTES_PER_TOKEN // 1000} KB/token\n1 Gbps link", ho["b_ref"]["landed_s"])]
    ax1.boxplot([np.asarray(s) * 1e3 for _, s in series], whis=(0, 100))
    ax1.set_xticks(range(1, len(series) + 1), [s for s, _ in series], fontsize=8)
    ax1.set_ylabel("ms")
    a = ho["a"]
    ax1.set_title(f"{results['config']['eager_tokens']}-token handoff, WAN {results['config']['handoff_latency_ms']:g} ms\n"
                  f"payload: {a['payload_json_mean']:.0f} B JSON vs {ho['b_ref']['payload_bytes'] / 1e6:.1f} MB KV",
                  fontsize=9)
    ax1.grid(axis="y", alpha=0.3)
    lat = results["config"]["latencies_ms"]
    styles = {"same_dc_pd": ("k", "-"), "p_rld_only": ("tab:gray", ":"), "p_rld_md": ("tab:blue", "-"),
              "p_md": ("tab:orange", "-")}
    for ctl, marker in (("local", "o"), ("wan", "s"), ("wan_serial", "^")):
        for path, (color, ls) in styles.items():
            key = "ttft_s"
            ys = [results["ttft"].get(f"{L:g}", {}).get(ctl, {}).get(path, {}).get(key, {}).get("p50") for L in lat]
            if path == "same_dc_pd" and ctl != "local":
                continue
            if any(y is not None for y in ys):
                ax2.plot(lat, [y * 1e3 if y is not None else np.nan for y in ys], color=color, ls=ls, marker=marker,
                         label=f"{path} ctl={ctl}" if path != "same_dc_pd" else "same-DC PD (P->RLD)")
        ys = [results["ttft"].get(f"{L:g}", {}).get(ctl, {}).get("p_md", {}).get("first_md_token_s", {}).get("p50")
              for L in lat]
        if any(y is not None for y in ys):
            ax2.plot(lat, [y * 1e3 if y is not None else np.nan for y in ys], color="tab:red", ls="--", marker=marker,
                     label=f"P->MD first MD token ctl={ctl}")
    ax2.set_xscale("log")
    ax2.set_xlabel("WAN one-way latency (ms)")
    ax2.set_ylabel("TTFT p50 (ms)")
    ax2.set_title("TTFT vs WAN latency (client side, streaming)", fontsize=9)
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20, help="handoffs / KV transfers measured in (a) and (b)")
    ap.add_argument("--eager-tokens", type=int, default=100, help="E: eager tokens handed off")
    ap.add_argument("--continuation-tokens", type=int, default=8, help="tokens MD generates after a handoff in (a)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in (a)/(b)")
    ap.add_argument("--handoff-latency-ms", type=float, default=20.0, help="one-way WAN latency for (a)/(b)")
    ap.add_argument("--jitter-ms", type=float, default=1.0)
    ap.add_argument("--equiv-gbps", type=float, default=1.0,
                    help="WAN rate the scaled KV link stands for (KV time of the reference model)")
    ap.add_argument("--latencies-ms", default="5,50,200", help="WAN one-way latencies for the TTFT sweep")
    ap.add_argument("--ttft-requests", type=int, default=3, help="M: requests per (latency, path, placement)")
    ap.add_argument("--ttft-prompt-tokens", type=int, default=512)
    ap.add_argument("--ttft-max-new", type=int, default=8)
    ap.add_argument("--request-timeout-s", type=float, default=90.0,
                    help="a TTFT request with no event for this long is recorded as an error")
    ap.add_argument("--placements", default="local,wan,wan_serial",
                    help="router placements: local, wan (DC A, registration concurrent), wan_serial (DC A, "
                         "registration before P/RLD)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="artifacts/bench_handoff")
    ap.add_argument("--run-dir", default=None, help="logs of the cluster (default: a temp dir)")
    ap.add_argument("--model", default=None, help="model dir (default: artifacts/tiny-llama)")
    args = ap.parse_args(argv)
    latencies = parse_csv_floats(args.latencies_ms)
    placements = [p for p in args.placements.split(",") if p]
    if set(placements) - {"local", "wan", "wan_serial"}:
        ap.error("--placements: any of local, wan, wan_serial")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from sglang_pdd.launcher.cluster import LocalCluster, default_model_path
    from sglang_pdd.launcher.topology import Topology, free_port, router_argv

    model = args.model or default_model_path()
    config = json.loads((Path(model) / "config.json").read_text())
    vocab, layers = int(config["vocab_size"]), int(config["num_hidden_layers"])
    # KV bytes/token of the served model as MD's pool holds it; confirmed by MD at registration.
    tiny_kv = 2 * layers * int(config["num_key_value_heads"]) * int(config.get("head_dim") or
                                                                    config["hidden_size"] // config["num_attention_heads"]) * 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="bench-handoff-"))
    topo = Topology.on_free_ports()
    topo.wan.rate_gbps = scaled_rate_gbps(args.equiv_gbps, tiny_kv)
    topo.wan.latency_ms, topo.wan.jitter_ms = args.handoff_latency_ms, args.jitter_ms
    # MD's control API behind its own emulated link: a TCP proxy on another port, which MD
    # answers to only once it is one of MD's names (--pdd-control-names HOST:PORT, as behind
    # any proxy or load balancer in a real deployment).
    ctl_listen, ctl_ctl, router2 = free_port(), free_port(), free_port()
    topo.main.extra_args += ["--pdd-control-names", f"127.0.0.1:{ctl_listen}"]
    t_start = time.perf_counter()
    results: dict = {"config": {**vars(args), "latencies_ms": latencies, "placements": placements,
                                "model": model, "machine": f"{os.cpu_count()}-core CPU, {platform.platform()}",
                                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                                "kv_link_rate_gbps": topo.wan.rate_gbps, "ref_kv_bytes_per_token": REF_KV_BYTES_PER_TOKEN}}
    print(f"cluster logs: {run_dir}/logs", file=sys.stderr)
    # the benchmark steers paths with pdd_options, an operator-only option (docs/api.md)
    with LocalCluster(run_dir, model_path=model, topology=topo, router_args=BENCH_ROUTER_ARGS) as cluster:
        # MD's control API behind its own emulated link (token-ID traffic: unscaled rate), and a
        # second router that reaches MD's control through it (router in datacenter A).
        cluster.procs.start("ctl-wan-emulator", [
            sys.executable, "-m", "sglang_pdd.launcher.wan_emulator", "--listen", f"127.0.0.1:{ctl_listen}",
            "--upstream", f"127.0.0.1:{topo.main.control_port}", "--latency-ms", str(args.handoff_latency_ms),
            "--jitter-ms", str(args.jitter_ms), "--rate-gbps", str(args.equiv_gbps),
            "--control", f"127.0.0.1:{ctl_ctl}"], health_url=f"http://127.0.0.1:{ctl_ctl}/stats")
        argv2 = router_argv(topo, model, BENCH_ROUTER_ARGS)
        i = argv2.index("--main") + 1
        argv2[i] = argv2[i].replace(topo.main.control_url, f"http://127.0.0.1:{ctl_listen}")
        argv2[argv2.index("--port") + 1] = str(router2)
        cluster.procs.start("router-ctl-wan", argv2, health_url=f"http://127.0.0.1:{router2}/health")
        # The same placement without P's control URL: registration before P and RLD start.
        router3 = free_port()
        argv3 = list(argv2)
        argv3[argv3.index("--port") + 1] = str(router3)
        j = argv3.index("--prefill") + 1
        argv3[j] = ",".join(argv3[j].split(",")[:2])
        cluster.procs.start("router-ctl-wan-serial", argv3, health_url=f"http://127.0.0.1:{router3}/health")
        cluster.procs.wait_healthy(["ctl-wan-emulator", "router-ctl-wan", "router-ctl-wan-serial"], timeout_s=120)
        bench = Bench(args, cluster, f"http://127.0.0.1:{ctl_ctl}", f"http://127.0.0.1:{ctl_listen}",
                      f"http://127.0.0.1:{router2}", vocab, f"http://127.0.0.1:{router3}")
        results["startup_s"] = time.perf_counter() - t_start

        # ---------------------------------------------------------------- (a)
        rng = random.Random(args.seed)
        prompts = [random_prompt(rng, args.prompt_tokens, vocab) for _ in range(args.n)]
        refs = bench.references(prompts, args.eager_tokens + args.continuation_tokens)
        rows_a = []
        # warm-up (first extend at MD, connections); any tokens will do, so reuse a reference's
        bench.token_handoff(random_prompt(rng, args.prompt_tokens, vocab), refs[0])
        for ids, ref in tqdm(list(zip(prompts, refs)), desc="(a) token-ID handoffs", file=sys.stderr):
            rows_a.append(bench.token_handoff(ids, ref))
        kv_per_token = rows_a[0]["kv_bytes_per_token"]
        if kv_per_token != tiny_kv:
            print(f"note: MD reports {kv_per_token} KV B/token (config estimate {tiny_kv})", file=sys.stderr)
        real_ids = random.Random(1).choices(range(REAL_VOCAB), k=args.eager_tokens)
        real_sizes = payload_sizes(handoff_message(real_ids, "0" * 32 + "-m", args.continuation_tokens, bench.greedy))
        a = {"rows": rows_a, "stall_s": [r["stall_s"] for r in rows_a], "total_s": [r["total_s"] for r in rows_a],
             "payload_json_mean": float(np.mean([r["payload_json"] for r in rows_a])),
             "payload_msgpack_mean": float(np.mean([r["payload_msgpack"] for r in rows_a])),
             "wire_bytes_up_mean": float(np.mean([r["wire_bytes_up"] for r in rows_a])),
             "real_vocab_payload": real_sizes,
             "all_match_reference": all(r["matches_reference"] for r in rows_a),
             "md_cached_tokens": [r["md_cached_tokens"] for r in rows_a]}

        # ---------------------------------------------------------------- (b)
        b_tiny = bench.kv_transfers(kv_per_token, layers, topo.wan.rate_gbps, args.handoff_latency_ms, args.jitter_ms,
                                    args.prompt_tokens, args.n, "(b) KV, tiny model, scaled link")
        b_ref = bench.kv_transfers(REF_KV_BYTES_PER_TOKEN, REF_NUM_LAYERS, args.equiv_gbps, args.handoff_latency_ms,
                                   args.jitter_ms, args.prompt_tokens, args.n,
                                   f"(b) KV, {REF_KV_BYTES_PER_TOKEN} B/token, {args.equiv_gbps:g} Gbps")
        results["handoff"] = {"a": a, "b_tiny": b_tiny, "b_ref": b_ref}

        # ---------------------------------------------------------------- TTFT
        ttft: dict = {}
        jobs = []
        for L in latencies:
            jobs.append((L, "local", "same_dc_pd"))
            for ctl in placements:
                for path in ("p_rld_only", "p_rld_md", "p_md"):
                    jobs.append((L, ctl, path))
        samples: dict = {}
        with tqdm(total=len(jobs) * args.ttft_requests, desc="TTFT requests", file=sys.stderr) as bar:
            for L in latencies:
                bench.set_latency(L)
                for _ in range(args.ttft_requests):
                    # interleave paths so drift on a shared machine hits all of them alike
                    for (L2, ctl, path) in jobs:
                        if L2 != L:
                            continue
                        ids = random_prompt(rng, args.ttft_prompt_tokens, vocab)
                        try:
                            if path == "same_dc_pd":
                                r = bench.same_dc_pd(ids)
                            else:
                                r = bench.route_stream(bench.routers[ctl], ids, path)
                        except (OSError, RuntimeError, ValueError) as e:  # timeouts included
                            print(f"\nTTFT request failed (latency {L:g} ms, ctl={ctl}, {path}): {e!r}",
                                  file=sys.stderr)
                            r = {"ttft_s": None, "first_md_token_s": None, "error": repr(e)}
                        samples.setdefault((L, ctl, path), []).append(r)
                        bar.update(1)
        for (L, ctl, path), rs in samples.items():
            ttft.setdefault(f"{L:g}", {}).setdefault(ctl, {})[path] = {
                "ttft_s": summarize(r["ttft_s"] for r in rs),
                "first_md_token_s": summarize(r["first_md_token_s"] for r in rs),
                "handoff_stall_s": summarize(r.get("handoff_stall_s") for r in rs),
                "handoffs": sum(r.get("handoff_at") is not None for r in rs),
                "errors": [r["error"] for r in rs if "error" in r],
                "fallbacks": [f for r in rs for f in (r.get("fallbacks") or [])],
                "samples": rs}
        results["ttft"] = ttft
        results["md_stats"] = get_json(f"{topo.main.control_url}{api.STATS.path()}", key=cluster.control_key)
        bench.set_latency(args.handoff_latency_ms)
    results["total_s"] = time.perf_counter() - t_start

    report(results, args, latencies, placements)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    try:
        plot(results, out_dir / "bench_handoff.png")
        print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'bench_handoff.png'}")
    except ImportError as e:
        print(f"\nwrote {out_dir / 'results.json'} (no plot: {e})")
    return 0


def report(results: dict, args, latencies: list[float], placements: list[str]) -> None:
    cfg = results["config"]
    ho = results["handoff"]
    a, bt, br = ho["a"], ho["b_tiny"], ho["b_ref"]
    E = args.eager_tokens
    print(f"\n=== Handoff overhead: {E} eager tokens, WAN {args.handoff_latency_ms:g} ms one-way "
          f"(+-{args.jitter_ms:g}), N={args.n}")
    print(f"machine: {cfg['machine']}; model {cfg['model']} ({a['rows'][0]['kv_bytes_per_token']} KV B/token; "
          f"reference design {REF_KV_BYTES_PER_TOKEN} B/token). KV link {cfg['kv_link_rate_gbps'] * 1e3:.2f} Mbps "
          f"= {args.equiv_gbps:g} Gbps scaled by {a['rows'][0]['kv_bytes_per_token']}/{REF_KV_BYTES_PER_TOKEN}; "
          f"control link {args.equiv_gbps:g} Gbps.")
    print("\nPayload per handoff (bytes crossing the WAN):")
    rows = [["(a) token IDs, JSON body (as pdd_flow.py counts)", f"{a['payload_json_mean']:.0f}", "-"],
            ["(a) token IDs, msgpack", f"{a['payload_msgpack_mean']:.0f}", "-"],
            ["(a) token IDs, on the wire (HTTP request incl. headers)", f"{a['wire_bytes_up_mean']:.0f}", "-"],
            [f"(a) JSON body with {REAL_VOCAB}-vocab ids (estimate)", f"{a['real_vocab_payload']['json']}", "-"],
            ["(b) incremental KV, tiny model", f"{bt['payload_bytes']}",
             f"{bt['payload_bytes'] / a['payload_json_mean']:.0f}x"],
            ["(b) incremental KV, tiny model, on the wire", f"{bt['wire_bytes_up_mean']:.0f}",
             f"{bt['wire_bytes_up_mean'] / a['wire_bytes_up_mean']:.0f}x"],
            [f"(b) incremental KV, reference {REF_KV_BYTES_PER_TOKEN} B/token", f"{br['payload_bytes']}",
             f"{br['payload_bytes'] / a['payload_json_mean']:.0f}x"]]
    print_table(["message", "bytes", "vs (a) JSON"], rows)
    print(f"\nHandoff latency (ms), N={args.n}:")
    hdr = ["variant", "mean", "p50", "p99", "max", "std"]
    rows = []
    for name, vals in [("(a) send -> MD's 1st continuation token (= MD stall)", a["stall_s"]),
                       (f"(a) send -> full response ({args.continuation_tokens} tokens)", a["total_s"]),
                       ("(b) tiny KV: begin_transfer -> receiver SUCCESS", bt["landed_s"]),
                       ("(b) tiny KV: begin_transfer -> sender ACK", bt["acked_s"]),
                       (f"(b) {REF_KV_BYTES_PER_TOKEN // 1000} KB/token KV: begin -> receiver SUCCESS", br["landed_s"]),
                       (f"(b) {REF_KV_BYTES_PER_TOKEN // 1000} KB/token KV: begin -> sender ACK", br["acked_s"])]:
        s = summarize(vals)
        rows.append([name] + [ms(s.get(k)) for k in ("mean", "p50", "p99", "max", "std")])
    for name, b in (("tiny KV", bt), (f"{REF_KV_BYTES_PER_TOKEN // 1000} KB/token KV", br)):
        rows.append([f"(b) {name}: ideal = one-way + bytes / line rate", ms(b["ideal_landed_s"]), "", "", "", ""])
    print_table(hdr, rows)
    if bt["landed_s"] and summarize(bt["landed_s"])["p50"] < 0.8 * bt["ideal_landed_s"]:
        print(f"note: the tiny-KV transfer beat line rate: the emulator's token bucket lets a burst of >= 64 KiB "
              f"through unshaped ({bt['payload_bytes']} B here), which at the scaled "
              f"{bt['rate_gbps'] * 1e3:.1f} Mbps is {65536 * 8 / bt['rate_gbps'] / 1e6:.0f} ms of line rate; "
              f"use the {REF_KV_BYTES_PER_TOKEN // 1000} KB/token row (or the ideal) for (b).")
    sa, sb = summarize(a["stall_s"]), summarize(br["landed_s"])
    print(f"of (a)'s stall, {2 * args.handoff_latency_ms:g} ms is the WAN round trip; the rest is MD's control hop, "
          f"its extend of {E} tokens and the first token on this (shared) CPU.")
    print(f"ratio (b, reference KV landed) / (a, first token) at p50: {sb['p50'] / sa['p50']:.2f}x. "
          f"(a) includes the MD extend of {E} tokens + 1st token and its return trip; (b) needs no extend "
          f"(0 compute) but excludes MD's decode step and the >= {args.handoff_latency_ms:g} ms return of the token.")
    print(f"MD continuation after (a) equals the reference greedy tokens: {a['all_match_reference']}; "
          f"MD's cached_tokens at the handoff (prompt from the WAN KV): {sorted(set(a['md_cached_tokens']))}")
    print(f"\nTTFT (client side, streaming, {args.ttft_prompt_tokens}-token prompts, M={args.ttft_requests}; ms; "
          "ratio = p50 / same-DC PD p50 at that latency):")
    rows = []
    for L in latencies:
        lat = results["ttft"].get(f"{L:g}", {})
        base = lat.get("local", {}).get("same_dc_pd", {}).get("ttft_s", {}).get("p50")
        for ctl in ["local"] + [p for p in placements if p != "local"]:
            for path in ("same_dc_pd", "p_rld_only", "p_rld_md", "p_md"):
                d = lat.get(ctl, {}).get(path)
                if d is None:
                    continue
                s = d["ttft_s"]
                rows.append([f"{L:g}", ctl if path != "same_dc_pd" else "-", path, ms(s.get("p50")), ms(s.get("p90")),
                             f"{ratio(s.get('p50'), base):.2f}" if ratio(s.get("p50"), base) else "-",
                             f"{d['handoffs']}/{s['n']}", ms(d["handoff_stall_s"].get("p50")), len(d["fallbacks"])])
                if path == "p_md":
                    f = d["first_md_token_s"]
                    rows.append([f"{L:g}", ctl, "P->MD (1st MD token)", ms(f.get("p50")), ms(f.get("p90")),
                                 f"{ratio(f.get('p50'), base):.2f}" if ratio(f.get("p50"), base) else "-",
                                 "", "", ""])
    print_table(["WAN ms", "ctl", "path", "p50", "p90", "ratio", "handoffs", "stall p50", "fallbacks"], rows)
    errors = [(L, ctl, path, e) for L, lat in results["ttft"].items() for ctl, d in lat.items()
              for path, x in d.items() for e in x.get("errors", [])]
    if errors:
        print(f"{len(errors)} TTFT request(s) failed and are left out of the table:")
        for e in errors:
            print(f"  latency {e[0]} ms, ctl={e[1]}, {e[2]}: {e[3][:160]}")
    print("\nSummary")
    print(f"  payload per {E}-token handoff: {a['payload_json_mean']:.0f} B JSON ({a['payload_msgpack_mean']:.0f} B "
          f"msgpack, {a['wire_bytes_up_mean']:.0f} B on the wire with HTTP headers; "
          f"{a['real_vocab_payload']['json']} B JSON with {REAL_VOCAB}-vocab ids) vs KV "
          f"{bt['payload_bytes'] / 1e3:.1f} KB (tiny) / {br['payload_bytes'] / 1e6:.1f} MB (reference); "
          f"goal < 1.5 KB: {'met' if max(a['payload_json_mean'], a['real_vocab_payload']['json']) < 1500 else 'NOT met'}")
    print(f"  MD stall (a): mean {ms(sa['mean'])} / p50 {ms(sa['p50'])} / p99 {ms(sa['p99'])} / max {ms(sa['max'])} "
          f"/ std {ms(sa['std'])} ms; (b) reference KV landed p50 {ms(sb['p50'])} ms")
    for ctl in placements:
        parts = []
        for L in latencies:
            lat = results["ttft"].get(f"{L:g}", {})
            base = lat.get("local", {}).get("same_dc_pd", {}).get("ttft_s", {}).get("p50")
            rld = lat.get(ctl, {}).get("p_rld_md", {}).get("ttft_s", {}).get("p50")
            pmd = lat.get(ctl, {}).get("p_md", {}).get("first_md_token_s", {}).get("p50")
            parts.append(f"{L:g} ms: P->RLD->MD {ms(rld)} vs P->MD {ms(pmd)} vs same-DC {ms(base)}")
        print(f"  TTFT p50 (ctl={ctl}): " + "; ".join(parts))
    if {"wan", "wan_serial"} <= set(placements):
        parts = []
        for L in latencies:
            lat = results["ttft"].get(f"{L:g}", {})
            conc = lat.get("wan", {}).get("p_rld_md", {}).get("ttft_s", {}).get("p50")
            serial = lat.get("wan_serial", {}).get("p_rld_md", {}).get("ttft_s", {}).get("p50")
            parts.append(f"{L:g} ms: {ms(conc)} vs {ms(serial)} ({ratio(conc, serial):.2f}x)"
                         if ratio(conc, serial) else f"{L:g} ms: -")
        print("  router in DC A, P->RLD->MD TTFT p50, MD registration concurrent vs before P/RLD: " + "; ".join(parts))
    print(f"  run time {results['total_s']:.0f} s (cluster start {results['startup_s']:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
