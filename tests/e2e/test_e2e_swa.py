"""A hybrid sliding-window model (tiny Mellum style, artifacts/tiny-mellum: layers sliding/full/
sliding/full, window 32) on real SGLang: SGLang gives it an SWAKVPool, the sliding layers in a
pool smaller than the full one.

Through PDD (one single server, then one cluster at --page-size 1 and one at 16): greedy
output_ids through P->MD and P->RLD->MD (one-shot and catch-up handoffs) equal the single
server's; the WAN carries the full layers' pages and only the sliding layers' window; a second
turn hits MD's SWA-aware DRC.

A soak (its own cluster) wraps the sliding-window pools of P, RLD and MD many times over with
multi-turn sessions on both paths: outputs equal, nothing lost or leaked.

The plain-server test is the real-server repro of patches/sglang-0003: with the SWA pool at 2%
of the full pool, a dozen sequential prompts push the full-pool indices past the SWA pool's
size; unpatched, torch_native reads an SWA layer with those indices and the scheduler dies
(IndexError). Its greedy output_ids are checked against transformers' own generate.
"""

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest

from sglang_pdd.launcher.http import post_json
from tests.support.waiting import wait_until
from tests.conftest import _require_sglang, plain_server
from tests.support.pdd_requests import TURN1, next_turn, single_server_reference

pytestmark = [pytest.mark.e2e, pytest.mark.full, pytest.mark.own_cluster]

NEW_TOKENS = 8


def _swa_model():
    _require_sglang()
    from sglang_pdd.launcher.cluster import default_swa_model_path

    return default_swa_model_path()


@pytest.fixture(scope="module")
def swa_model():
    return _swa_model()


def random_prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def transformers_greedy(model_path: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 min_new_tokens=new_tokens)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def test_small_swa_pool_serves_sequential_prompts_past_its_size(run_root, swa_model, servers_under_test):
    servers_under_test.stop()
    prompts = random_prompts(12, 100, 210)
    # 65536 full slots, 1310 SWA slots: the radix cache keeps every prompt, so full-pool indices
    # pass the SWA pool's size by the 8th prompt while the SWA pool frees what leaves the window
    args = ("--dtype", "float32", "--swa-full-tokens-ratio", "0.02")
    with plain_server(run_root, swa_model, name="single-swa-small", extra_args=args) as url:
        got = [post_json(f"{url}/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}, timeout=300)["output_ids"]
               for ids in prompts]
        log = (run_root / "single-swa-small-logs" / "single-swa-small.log").read_text(errors="replace")
    swa_size = int(re.search(r"swa size: (\d+)", log).group(1))
    assert swa_size < sum(len(p) + NEW_TOKENS for p in prompts)  # the run passes the SWA pool's size
    assert got == transformers_greedy(swa_model, prompts, NEW_TOKENS)


# ---------------------------------------------------------------- end to end through PDD

# 36-105 tokens (the tiny tokenizer), longer than the window (32): the sliding layers' KV of the
# first tokens never crosses the WAN. Short enough for the tests' slow emulated WAN (0.5 Mbit/s).
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import collections\n\nclass LRUCache:\n    def __init__(self, capacity):\n        self.data = {}\n" * 2,
    "The quick brown fox jumps over the lazy dog. " * 4,
]


@pytest.fixture(scope="module")
def swa_reference(run_root, swa_model, servers_under_test):
    """Greedy output_ids of a plain single server on the hybrid model (stopped before the cluster)."""
    servers_under_test.stop()
    with plain_server(run_root, swa_model, name="single-swa") as url:
        return single_server_reference(url, PROMPTS)


@pytest.fixture(scope="module")
def swa_cluster(run_root, swa_model, swa_reference, servers_under_test):
    from tests.conftest import start_pdd_cluster

    return servers_under_test.get("cluster-swa", lambda: start_pdd_cluster(run_root, "cluster-swa",
                                                                           model_path=swa_model))


def _window(cluster) -> int:
    log = (cluster.procs.log_dir / "main-0.log").read_text(errors="replace")
    return int(re.search(r"KV pool kind=mha buffers=8 .* window_buffers=4 window=(\d+)", log).group(1))


@pytest.mark.parametrize("options", [{"path": "p_md"}, {"path": "p_rld_md", "handoff_mode": "one_shot"},
                                     {"path": "p_rld_md", "handoff_mode": "catch_up"}],
                         ids=lambda o: o.get("handoff_mode", o["path"]))
def test_swa_output_ids_equal_single_server(swa_cluster, swa_reference, options):
    from tests.support.pdd_requests import assert_routes_equal_reference

    assert_routes_equal_reference(swa_cluster, {p: swa_reference[p] for p in PROMPTS}, options)


def test_swa_wan_sends_full_layers_and_only_the_window_of_sliding_ones(swa_cluster):
    """P's WAN bytes for one P->MD request: the full layers' pages MD lacks and the sliding
    layers' window only; printed beside what a full-attention-only plan would send. MD reports
    its KV size that way (full layers per token, the sliding ones per window token), so the
    router's count of the request's WAN bytes (from MD's registration answer, the size its
    path estimate uses) and MD's count of bytes landed are P's."""
    from sglang_pdd.chaos.probe import scrape
    from sglang_pdd.control.auth import ROLE_P
    from sglang_pdd.launcher.http import get_json
    from tests.support.pdd_requests import route

    window = _window(swa_cluster)
    stats_url, key = f"{swa_cluster.topology.prefill.control_url}/pdd/stats", swa_cluster.control_key
    md_stats_url = f"{swa_cluster.topology.main.control_url}/pdd/stats"
    token_bytes = 2 * 32 * 4  # 2 KV heads x head_dim 32 x fp32, per buffer
    md_stats = get_json(md_stats_url, key=key)
    assert (md_stats["kv_bytes_per_token"], md_stats["kv_window_tokens"], md_stats["kv_window_bytes_per_token"]) \
        == (4 * token_bytes, window, 4 * token_bytes)

    def router_wan_bytes() -> float:
        return sum(v for (name, _), v in scrape(swa_cluster.topology.router_url).items()
                   if name == "pdd:wan_bytes_total")

    for prompt in PROMPTS[2:] + ["word " * 40]:
        before = get_json(stats_url, key=key, role=ROLE_P)["bytes"]
        router_before, md_before = router_wan_bytes(), get_json(md_stats_url, key=key)["wan_bytes"]
        got = route(swa_cluster, prompt, path="p_md", drc=False)
        pdd, n = got["meta_info"]["pdd"], got["meta_info"]["prompt_tokens"]
        assert not pdd["fallbacks"], pdd
        cached = pdd["md_cached_tokens"]
        assert n > window + cached
        expected = (4 * (n - cached) + 4 * (n - max(cached, n - window))) * token_bytes

        def sent() -> int:  # P counts a transfer's bytes once its last chunk is queued
            return get_json(stats_url, key=key, role=ROLE_P)["bytes"] - before

        wait_until(lambda: sent() >= expected, 10)
        sent = sent()
        full_only = 8 * (n - cached) * token_bytes
        print(f"hybrid SWA model, prompt {n} tokens, MD held {cached}: WAN {sent} B with the window, "
              f"{full_only} B sent like full attention ({sent / full_only:.2f}x)")
        assert sent == expected
        # the router counts a transfer once its flow has ended
        assert wait_until(lambda: router_wan_bytes() - router_before == sent, 10, poll_s=0.2), \
            router_wan_bytes() - router_before
        assert get_json(md_stats_url, key=key)["wan_bytes"] - md_before == sent


def test_swa_drc_second_turn_hits_md_and_sends_only_the_suffix(swa_cluster, swa_reference):
    from tests.support.pdd_requests import assert_second_turn_sends_only_the_suffix

    turn1_tokens, cached = assert_second_turn_sends_only_the_suffix(swa_cluster, TURN1, swa_reference.__getitem__,
                                                                    next_turn)
    assert cached >= turn1_tokens - 1  # turn 1's prompt (the last token may be recomputed)


# ---------------------------------------------------------------- paged pools (--page-size 16)

PAGE = 16


@pytest.fixture(scope="module")
def swa_cluster_paged(run_root, swa_model, swa_reference, servers_under_test):
    """P, RLD and MD at --page-size 16: SGLang's paged SWA allocator on each side."""
    from tests.conftest import start_pdd_cluster

    return servers_under_test.get("cluster-swa-page16", lambda: start_pdd_cluster(
        run_root, "cluster-swa-page16", page_size=PAGE, model_path=swa_model))


@pytest.mark.parametrize("options", [{"path": "p_md"}, {"path": "p_rld_md", "handoff_mode": "one_shot"},
                                     {"path": "p_rld_md", "handoff_mode": "catch_up"}],
                         ids=lambda o: o.get("handoff_mode", o["path"]))
def test_swa_at_page_size_16_output_ids_equal_single_server(swa_cluster_paged, swa_reference, options):
    from tests.support.pdd_requests import assert_routes_equal_reference

    assert_routes_equal_reference(swa_cluster_paged, {p: swa_reference[p] for p in PROMPTS}, options)


def test_swa_at_page_size_16_second_turn_hits_md_in_whole_pages(swa_cluster_paged, swa_reference):
    from tests.support.pdd_requests import assert_second_turn_sends_only_the_suffix

    log = (swa_cluster_paged.procs.log_dir / "main-0.log").read_text(errors="replace")
    assert re.search(r"KV pool kind=mha buffers=8 page_size=16 .* window_buffers=4 window=\d+", log)
    turn1_tokens, cached = assert_second_turn_sends_only_the_suffix(swa_cluster_paged, TURN1,
                                                                    swa_reference.__getitem__, next_turn)
    assert cached % PAGE == 0 and cached >= turn1_tokens - PAGE  # turn 1's prompt, its whole pages


# ---------------------------------------------------------------- a soak that wraps the sliding-window pools

# --swa-full-tokens-ratio on P, RLD and MD: 65536 full slots, 1310 sliding-window slots each, so
# the sliding pool's slots are freed and taken again many times over (the repro ratio)
SOAK_RATIO = "0.02"
SOAK_SESSIONS, SOAK_TURNS, SOAK_CONCURRENT, SOAK_NEW = 24, 5, 4, 32
# session s goes through SOAK_OPTIONS[s % 3]: P->MD, and P->RLD->MD handing off in each mode
SOAK_OPTIONS = [{"path": "p_md"}, {"path": "p_rld_md", "handoff_mode": "one_shot"},
                {"path": "p_rld_md", "handoff_mode": "catch_up"}]
# MD's KV lands in ~0.1 s (a turn is ~250-400 KB), while RLD still streams: P->RLD->MD hands off
SOAK_WAN_GBPS = 0.02


def soak_body(ids: list[int], options: Optional[dict] = None) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": SOAK_NEW, "temperature": 0}}
    return body if options is None else {**body, "pdd_options": options}


@pytest.fixture(scope="module")
def soak_reference(run_root, swa_model, servers_under_test):
    """The soak's sessions as one plain server (default pools: nothing wraps) answers them:
    per session, its turns as (input_ids, greedy output_ids). A session's first prompt has
    100-210 tokens; each later turn is the one before, its answer and 10-39 new tokens."""
    servers_under_test.stop()
    rng = random.Random(45)
    sessions = []
    with plain_server(run_root, swa_model, name="single-swa-soak") as url:
        for conversation in random_prompts(SOAK_SESSIONS, 100, 210, seed=45):
            turns = []
            for _ in range(SOAK_TURNS):
                out = post_json(f"{url}/generate", soak_body(conversation), timeout=300)["output_ids"]
                turns.append((conversation, out))
                conversation = conversation + out + [rng.randrange(3, 1024) for _ in range(rng.randrange(10, 40))]
            sessions.append(turns)
    return sessions


@pytest.fixture(scope="module", params=[1, PAGE], ids=lambda n: f"page{n}")
def swa_soak_cluster(run_root, swa_model, soak_reference, servers_under_test, request):
    from tests.conftest import EXACT_ARGS, start_pdd_cluster

    args = (*EXACT_ARGS, "--swa-full-tokens-ratio", SOAK_RATIO)
    name = f"cluster-swa-soak-page{request.param}"
    cluster = servers_under_test.get(name, lambda: start_pdd_cluster(
        run_root, name, page_size=request.param, model_path=swa_model, extra_args=args))
    cluster.page_size = request.param
    return cluster


def prefilled_tokens(url: str) -> int:
    """SGLang's count of the tokens a server's prefills and extends computed (cache hits
    excluded), summed over its ranks: each took a sliding-window slot."""
    from sglang_pdd.launcher.http import get_json

    loads = get_json(f"{url}/v1/loads?include=all")["loads"]
    return sum(int(load.get("total_prefill_uncached_tokens", load.get("core", {}).get(
        "total_prefill_uncached_tokens", 0))) for load in loads)


def test_swa_soak_wraps_the_sliding_window_pools_through_both_paths(swa_soak_cluster, soak_reference):
    """Multi-turn sessions, four at a time, through P->MD and P->RLD->MD (one-shot and
    catch-up handoffs) on servers whose sliding-window pools hold 2% of the full pool's
    tokens, at page size 1 and 16: the sliding slots are taken and freed many times over on
    P, RLD and MD. Every
    turn's greedy output_ids equal the plain server's, none falls back or is lost; afterwards
    no server holds a request, a room, a WAN slot or (after a flush) a KV slot, and no
    server logged a leak (SGLang's idle checks, both pools, raise on one)."""
    from sglang_pdd.chaos import probe
    from sglang_pdd.chaos.runner import settle_and_flush
    from sglang_pdd.kv_channel.layout import num_pages, window_first_page
    from tests.support.takeover import stream_final

    cluster, topo, page = swa_soak_cluster, swa_soak_cluster.topology, swa_soak_cluster.page_size
    window = _window(cluster)
    cluster.wan_control("link", rate_gbps=SOAK_WAN_GBPS)
    offsets = probe.log_offsets(cluster.procs.log_dir)
    prefilled = {spec.name: prefilled_tokens(spec.url) for spec in topo.servers}

    def session(s: int) -> list[tuple[dict, list[int]]]:
        options = SOAK_OPTIONS[s % len(SOAK_OPTIONS)]
        out = []
        for ids, want in soak_reference[s]:
            if options["path"] == "p_rld_md":  # streamed: each token once, in order
                got = stream_final(topo.router_url, soak_body(ids, options))
            else:
                got = post_json(f"{topo.router_url}/generate", soak_body(ids, options), timeout=300)
            out.append((got, want))
        return out

    started = time.monotonic()
    with ThreadPoolExecutor(SOAK_CONCURRENT) as pool:
        results = list(pool.map(session, range(SOAK_SESSIONS)))
    elapsed = time.monotonic() - started
    leaks = settle_and_flush(cluster, offsets)

    handoffs = {"p_md": 0, "one_shot": 0, "catch_up": 0}
    md_tokens = rld_tokens = windows = drc_hits = relay_prealloc = 0
    relay_handoff_at = []
    for s, turns in enumerate(results):
        options = SOAK_OPTIONS[s % len(SOAK_OPTIONS)]
        for t, (got, want) in enumerate(turns):
            pdd = got["meta_info"]["pdd"]
            assert got["output_ids"] == want, (s, t, pdd)
            assert not pdd["fallbacks"], (s, t, pdd)
            assert pdd["rld_tokens"] + pdd["md_tokens"] == len(want), (s, t, pdd)
            handoffs[options.get("handoff_mode", "p_md")] += pdd["md_tokens"] > 0
            if options["path"] == "p_rld_md" and pdd["md_tokens"]:
                relay_handoff_at.append(pdd["handoff_at"])
            md_tokens, rld_tokens = md_tokens + pdd["md_tokens"], rld_tokens + pdd["rld_tokens"]
            n, cached = len(soak_reference[s][t][0]), pdd["md_cached_tokens"]
            # SGLang's decode side preallocates the whole prompt in both pools at page size 1,
            # the window's pages of the sliding one above (disaggregation/decode.py _prealloc_kv_lens)
            relay_prealloc += n if page == 1 else n - window_first_page(n, 0, window, page) * page
            if pdd["md_tokens"]:  # MD reserved the window's pages
                windows += (num_pages(n, page) - window_first_page(n, cached, window, page)) * page
            drc_hits += t > 0 and cached > 0
    requests = SOAK_SESSIONS * SOAK_TURNS
    sizes = {spec.name: swa_pool_size(cluster, spec.name) for spec in topo.servers}
    computed = {spec.name: prefilled_tokens(spec.url) - prefilled[spec.name] for spec in topo.servers}
    # sliding-window slots each server took (lower bounds): P one per token it prefilled; MD
    # one per token its handoff extends computed, per window token landed and per token it
    # decoded; RLD its preallocation for each request (every request has an RLD leg: P->MD's
    # relays P's first token) and one per token it decoded
    taken = {topo.prefill.name: computed[topo.prefill.name],
             topo.main.name: computed[topo.main.name] + windows + md_tokens,
             topo.relay.name: relay_prealloc + rld_tokens}
    print(f"\nSWA soak, page size {page}: {requests} requests in {SOAK_SESSIONS} sessions ({elapsed:.0f} s), "
          f"all equal to one server, no fallback; handoffs to MD {handoffs} (P->RLD->MD at tokens "
          f"{min(relay_handoff_at, default=0)}-{max(relay_handoff_at, default=0)}); later turns hitting MD's DRC "
          f"{drc_hits} of {requests - SOAK_SESSIONS}; sliding-window slots taken vs pool size: " + ", ".join(
              f"{name} >= {taken[name]} / {sizes[name]} ({taken[name] / sizes[name]:.1f}x)" for name in taken))
    assert leaks == [], leaks
    # P's and MD's sliding-window pools wrapped several times over; RLD's too at page size 1
    # (at 16 its decode side sizes a larger pool and preallocates only the window: ~1x)
    for name in (topo.prefill.name, topo.main.name) + ((topo.relay.name,) if page == 1 else ()):
        assert taken[name] >= 3 * sizes[name], (name, taken[name], sizes[name])
    assert handoffs["p_md"] == requests // 3 and handoffs["one_shot"] > 0 and handoffs["catch_up"] > 0, handoffs
    assert drc_hits > 0


def swa_pool_size(cluster, name: str) -> int:
    log = (cluster.procs.log_dir / f"{name}.log").read_text(errors="replace")
    return int(re.search(r"swa size: (\d+)", log).group(1))
