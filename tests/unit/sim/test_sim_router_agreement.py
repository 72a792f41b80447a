"""The simulator decides a request's path exactly as the real router does: same function,
same inputs (router/flow/pdd_flow.py's PddFlow._decide vs sim's Simulation.decide)."""

import dataclasses

import pytest

from sglang_pdd.router.flow.pdd_flow import FlowConfig, FlowResult, PddFlow

from sglang_pdd.router.flow.pick import ServerPick

from sglang_pdd.router.backends.servers import PrefillBackend
from sglang_pdd.router.policy import Path, PathMode
from sglang_pdd.router.backends.wan_in_flight import WanInFlight
from sglang_pdd.sim.cluster import ScenarioConfig, SimRequest, Simulation
from sglang_pdd.sim.hardware import TOY_A, TOY_B
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.workload import TraceRequest

SLA = Sla(ttft_s=2.0)
# The router's RLD admission (--rld-max-running) 128 here, so the table's loads read as
# fractions of it; RLD's own batch cap (TOY_A's max_running_requests) is another number.
CFG = ScenarioConfig("pdd", "pdd", n_prefill=2, n_rld=1, n_md=1, prefill_hw=TOY_A, rld_hw=TOY_A, md_hw=TOY_B,
                     rld_max_running=128)
RELAY_FIRST = dataclasses.replace(CFG, path_mode=PathMode.RELAY_FIRST)
MAX_RUNNING = CFG.rld_max_running

# (input tokens, MD's cached prefix, max_new_tokens or None, other flows in flight on RLD,
#  other prefill tokens in flight on P[, the sizes of the waited WAN transfers the router has in flight])
TABLE = [
    (2_000, 0, 200, 0, 0),  # idle RLD: relay-first hides the WAN, fit keeps a short transfer on P->MD
    (2_000, 0, 200, 127, 0),  # busy RLD: the whole slack, a short transfer fits
    (20_000, 19_500, 300, 110, 0),  # high MD hit, busy RLD: a tiny suffix -> P->MD
    (20_000, 19_500, 300, 0, 0),  # high MD hit, idle RLD
    (20_000, 19_500, 300, 0, 400_000),  # the same behind a long P queue: no budget left
    (20_000, 19_500, 300, 0, 0, (10**9,) * 2000),  # the same beside 2000 waited transfers of 1 GB, not landed
    (20_000, 19_500, 300, 0, 0, (10**11,)),  # beside one of 100 GB: the link is shared, ours lands first
    (20_000, 0, 300, 110, 0),  # same prompt, no hit: 20k tokens on the WAN miss the budget
    (60_000, 0, 8, 0, 0),  # outlier: long prompt, tiny output -> RLD only
    (60_000, 0, None, 0, 0),  # unknown output: no outlier filter
    (40_000, 39_000, 500, 90, 0),  # between idle and busy: part of the slack
    (40_000, 39_000, 500, 70, 0),  # a little less busy
    (8_000, 7_680, 64, 200, 0),  # RLD overloaded (util > 1)
]


def router_decision(route_cfg, inp, md_cached, max_new, rld_others, p_queued=0, wan_sizes=(),
                    rld_max_running=MAX_RUNNING):
    flow = object.__new__(PddFlow)  # only the attributes _decide reads
    flow.ids = [7] * inp
    flow.max_new = max_new
    flow.pick = ServerPick(PrefillBackend("http://p", 1), "http://rld", rld_inflight=rld_others, p_queued_tokens=p_queued)
    flow.wan_in_flight = WanInFlight()
    for i, size in enumerate(wan_sizes):
        flow.wan_in_flight.sending(f"other{i}", size)
    flow.result = FlowResult(rid="r", p_cached_estimate=0)
    flow.cfg = FlowConfig(path=route_cfg, rld_max_running=rld_max_running)
    return flow._decide(md_cached)


def sim_decision(sim, inp, md_cached, max_new, rld_others, p_queued=0, wan_sizes=()):
    sim.rld_flows[0] = rld_others + 1  # the request itself is counted once routed, on RLD and P
    r = SimRequest(TraceRequest(0.0, inp, max_new if max_new is not None else 100, ()), 0.0)
    r.rld, r.p, r.p_tok = 0, 0, inp  # P holds none of the prompt
    sim.p_tokens[0] = p_queued + r.p_tok
    sim.wan_waited = WanInFlight()
    for i, size in enumerate(wan_sizes):
        sim.wan_waited.sending(i, size)
    return sim.decide(r, md_cached)


@pytest.mark.parametrize("cfg", [CFG, RELAY_FIRST], ids=["fit", "relay_first"])
@pytest.mark.parametrize("row", TABLE)
def test_sim_and_router_choose_the_same_path(row, cfg):
    max_new = row[2]
    if max_new is None:
        cfg = dataclasses.replace(cfg, expected_output_from_trace=False)
    sim = Simulation(cfg, SLA)
    a = router_decision(sim.route_cfg, *row)
    b = sim_decision(sim, *row)
    assert (b.path, b.budget_ms, b.est_wan_transfer_ms) == (a.path, a.budget_ms, a.est_wan_transfer_ms)


@pytest.mark.parametrize("cfg", [CFG, RELAY_FIRST], ids=["fit", "relay_first"])
def test_table_covers_every_path_and_both_budget_ends(cfg):
    sim = Simulation(cfg, SLA)
    decisions = [router_decision(sim.route_cfg, *row) for row in TABLE if row[2] is not None]
    assert {d.path for d in decisions} == set(Path)
    budgets = [d.budget_ms for d in decisions if d.path is not Path.P_RLD_ONLY]
    # the widest budget: the whole slack less the 2000-token row's own prefill on P, its
    # attention term included (the profile's, as the router's --p-prefill-s-per-token-ctx)
    from sglang_pdd.router.policy import prefill_ms
    own_prefill_ms = prefill_ms(2_000, 0, sim.route_cfg)
    assert own_prefill_ms == pytest.approx(1e3 * (TOY_A.prefill_time_s(2_000, 0) - TOY_A.prefill_overhead_s))
    assert own_prefill_ms > 2e6 * TOY_A.prefill_s_per_token  # more than the linear estimate
    slack = SLA.ttft_s * 1e3 * (1 - sim.route_cfg.ttft_safety_fraction) - own_prefill_ms
    assert min(budgets) == 0.0 and max(budgets) == pytest.approx(slack)
    assert any(0.0 < b < slack for b in budgets)


def test_fit_keeps_high_hit_requests_on_p_md_while_relay_first_relays_them():
    """The two modes part on an idle RLD: fit sends the high-hit request P->MD, relay-first
    through RLD; behind a long P queue or a WAN full of the router's waited transfers both relay.
    Beside one huge transfer fit still sends it P->MD: the two share the link, the small one
    lands first (counting the huge one as ahead of it relayed every such request)."""
    paths = {}
    for name, cfg in (("fit", CFG), ("relay_first", RELAY_FIRST)):
        sim = Simulation(cfg, SLA)
        paths[name] = (sim_decision(sim, 20_000, 19_500, 300, 0).path,
                       sim_decision(sim, 20_000, 19_500, 300, 0, 400_000).path,
                       sim_decision(sim, 20_000, 19_500, 300, 0, 0, (10**9,) * 2000).path,
                       sim_decision(sim, 20_000, 19_500, 300, 0, 0, (10**11,)).path)
    assert paths == {"fit": (Path.P_MD, Path.P_RLD_MD, Path.P_RLD_MD, Path.P_MD),
                     "relay_first": (Path.P_RLD_MD,) * 4}


def test_sim_path_decision_reads_the_routers_admission_value():
    """The sim's RLD load is its flows over the router's --rld-max-running (ScenarioConfig.
    rld_max_running, the router's default unless set), not RLD's batch cap: the same flows
    decide alike in the router and the sim for every admission value, and RLD's batch cap
    moves nothing."""
    from sglang_pdd.router.front.cli import parse_args
    from sglang_pdd.router.policy import RLD_MAX_RUNNING_DEFAULT
    router_args = parse_args(["--prefill", "http://p:1,8998", "--relay", "http://r:1", "--tokenizer-path", "x"])
    assert ScenarioConfig("pdd", "pdd", 1, 1, 1).rld_max_running == router_args.rld_max_running \
        == RLD_MAX_RUNNING_DEFAULT
    assert ScenarioConfig("pdd", "pdd", 1, 1, 1).path_mode.value == router_args.path_mode
    row = (20_000, 19_500, 300, 12)  # a tiny suffix; RLD has 12 other flows
    paths = set()
    for admission in (8, 16, 24, 64, 512):
        for batch_cap in (16, 512):
            cfg = dataclasses.replace(RELAY_FIRST, rld_max_running=admission,
                                      rld_hw=dataclasses.replace(TOY_A, max_running_requests=batch_cap))
            sim = Simulation(cfg, SLA)
            a = router_decision(sim.route_cfg, *row, rld_max_running=admission)
            b = sim_decision(sim, *row)
            assert (b.path, b.budget_ms) == (a.path, a.budget_ms), (admission, batch_cap)
            paths.add((admission, b.path))
    # 12 flows busy an admission of 8 or 16 (util >= 0.75) and idle one of 24 or more
    assert {(8, Path.P_MD), (16, Path.P_MD), (24, Path.P_RLD_MD), (512, Path.P_RLD_MD)} <= paths


def test_sim_decision_ignores_what_the_router_cannot_see():
    """P's real backlog (beyond the prefill tokens the router counts on it) and WAN traffic
    in flight do not change the sim's decision: the router sees neither."""
    sim = Simulation(CFG, SLA)
    row = (20_000, 19_500, 300, 110)
    before = sim_decision(sim, *row)
    sim.prefill[0].submit(0.0, object(), 500_000, 0)  # a big backlog on P 0
    assert sim.prefill[0].backlog_s() > SLA.ttft_s
    assert sim_decision(sim, *row) == before


def _p_choices(cfg, trace):
    sim = Simulation(cfg, SLA)
    seen = []
    for i, p in enumerate(sim.prefill):
        p.submit = (lambda i, f: lambda now, r, *a: (seen.append(i), f(now, r, *a)))(i, p.submit)
    sim.run(trace)
    return seen


def test_pdd_places_prefill_by_prefix_like_the_router():
    """One shared prefix, requests far apart: the router's P index keeps them on the P that
    served the first one; the round-robin what-if alternates."""
    trace = [TraceRequest(1000.0 * i, 1024, 4, (1, 2)) for i in range(4)]
    assert _p_choices(CFG, trace) == [0, 0, 0, 0]
    assert _p_choices(ScenarioConfig(**{**CFG.__dict__, "p_placement": "round_robin"}), trace) == [0, 1, 0, 1]
    assert len(set(_p_choices(ScenarioConfig(**{**CFG.__dict__, "p_placement": "backlog"}), trace))) == 1
    assert _p_choices(ScenarioConfig(**{**CFG.__dict__, "p_placement": "flows"}), trace) == [0, 0, 0, 0]
    # no shared prefix, equal loads: the rotation makes them take turns
    fresh = [TraceRequest(1000.0 * i, 1024, 4, (10 * i + 1, 10 * i + 2)) for i in range(4)]
    assert _p_choices(CFG, fresh) == [0, 1, 0, 1]


# ---- one place: the router's own functions decide the sim's placement, path and lifecycle

def test_sim_places_p_rld_and_md_as_pools_pick():
    """Random loads and prefix owners: the sim's P, RLD and MD choice for a PDD request is
    router/backends/pools.py's Pools.pick (16-token blocks there, one trace block here),
    every server healthy. Several picks per state with the counters in step: P's rotation
    decides among equal candidates (frequent here: loads from 0-2, often no prefix)."""
    import random
    from types import SimpleNamespace

    from sglang_pdd.router.backends.pools import Pools
    rng = random.Random(1)
    cfg = ScenarioConfig("pdd", "pdd", n_prefill=3, n_rld=3, n_md=4, prefill_hw=TOY_A, rld_hw=TOY_A, md_hw=TOY_B)
    tokens = list(range(1000, 1000 + 16 * 6))
    hashes = list(range(6))
    p_seen, p_rotated = set(), 0
    md_kept = md_moved = 0
    for _ in range(300):
        sim = Simulation(cfg, SLA)
        ps = [SimpleNamespace(url=f"http://p{i}") for i in range(3)]
        rlds = [f"http://rld{i}" for i in range(3)]
        mds = [SimpleNamespace(url=f"http://md{i}", kv_bytes_per_token=None) for i in range(4)]
        # the sim's cost of a move; 32x the KV per token for the router's 16-token blocks (the
        # sim's are 512), so that one held block weighs the same bytes in both
        pools = Pools(ps, rlds, mds, md_move=dataclasses.replace(
            sim.md_move, kv_bytes_per_token=sim.md_move.kv_bytes_per_token * 512 // 16))
        assert all(pools.health.pickable(("prefill", p.url), 0.0) for p in ps)
        for i in range(3):
            # P's load is prefill tokens in flight, in blocks here (16 tokens a block there,
            # 512 here), so the held-prefix bound compares alike
            load = rng.choice((0, 0, 1, 2, 4, 6, 9))
            pools.p_tokens[ps[i].url], sim.p_tokens[i] = 16 * load, 512 * load
            held = rng.choice((0, 0, 1, 3, 6))
            if held:
                pools.prefixes.record(ps[i].url, tokens[:16 * held])
                sim.p_index.record_blocks(i, hashes[:held])
        for turn in range(rng.randrange(3) + 1):  # both counters advance together
            prefill, _, _ = pools.pick(tokens, now=0.0)
            p = sim.pick_p(hashes)
            assert ps[p] is prefill
            p_seen.add(p)
            p_rotated += p != 0 and sim.p_tokens[p] == min(sim.p_tokens) == sim.p_tokens[0] \
                and sim.p_index.match_blocks(p, hashes) == sim.p_index.match_blocks(0, hashes)
        for i in range(3):
            pools.rld_inflight[rlds[i]] = sim.rld_flows[i] = rng.randrange(4)
        for i in range(4):
            pools.md_inflight[mds[i].url] = sim.md_flows[i] = rng.randrange(9)
            held = rng.choice((0, 0, 1, 3, 6))
            if held:
                pools.prefixes.record(mds[i].url, tokens[:16 * held])
                sim.md_index.record_blocks(i, hashes[:held])
        # 8 output tokens: a held block is worth ~1 excess flow, 6 blocks ~6 (stays and moves both)
        _, relay, main = pools.pick(tokens, now=0.0, max_new_tokens=8)
        assert rlds[sim.pick_rld()] == relay
        md = sim.pick_md(hashes, 8)
        assert mds[md] is main
        owner, held = sim.md_index.best_blocks(sorted(range(4), key=sim.md_flows.__getitem__), hashes)
        if held:
            md_kept += md == owner
            md_moved += md != owner
    assert p_seen == {0, 1, 2} and p_rotated > 10  # ties broken by the rotation, not index order
    assert md_kept > 20 and md_moved > 20


def test_a_change_to_the_router_policy_changes_the_sims_routing(monkeypatch):
    """The sim calls router/policy.py at run time: patching the policy (here the function
    decide_path calls) moves both the router's decision and every simulated request."""
    from sglang_pdd.router import policy
    from sglang_pdd.sim.workload import generate_agentic_trace, realistic_agentic_config
    trace = list(generate_agentic_trace(realistic_agentic_config(num_requests=150, seed=2)))
    base = Simulation(CFG, SLA).run(trace)
    assert base.paths.get("p_rld_md", 0) > 0
    for forced in (Path.P_MD, Path.P_RLD_ONLY):
        monkeypatch.setattr(policy, "choose_path",
                            lambda facts, cfg, forced=forced: policy.PathDecision(forced, facts.input_tokens, 0.0, "test"))
        sim = Simulation(ScenarioConfig(**{**CFG.__dict__, "md_staging_bytes": float("inf")}), SLA)  # no refusals
        assert router_decision(sim.route_cfg, 2_000, 0, 200, 0).path is forced
        s = sim.run(trace)
        assert s.paths == {forced.value: len(trace)}
        if forced is Path.P_RLD_ONLY:
            assert s.wan_gb == 0 and s.switches == 0 and s.kv_landed == 0


def _counting_transition(monkeypatch, drop=None):
    """Wrap router/lifecycle.transition: record every (event, phase after); optionally make
    one event type a no-op (state kept, no actions)."""
    from sglang_pdd.router.flow import lifecycle
    real, seen = lifecycle.transition, []

    def wrapped(state, event):
        if drop is not None and isinstance(event, drop):
            return state, []
        new, actions = real(state, event)
        seen.append((type(event).__name__, new.phase))
        return new, actions
    monkeypatch.setattr(lifecycle, "transition", wrapped)
    return seen


def test_sim_requests_live_through_the_routers_lifecycle(monkeypatch):
    from sglang_pdd.router.flow.lifecycle import RequestPhase
    from sglang_pdd.sim.workload import generate_agentic_trace, realistic_agentic_config
    trace = list(generate_agentic_trace(realistic_agentic_config(num_requests=150, seed=2)))
    seen = _counting_transition(monkeypatch)
    cfg = ScenarioConfig(**{**CFG.__dict__, "n_md": 2})
    s = Simulation(cfg, SLA).run(trace)
    names = [e for e, _ in seen]
    assert names.count("PathChosen") == len(trace)
    # every request ends in DONE exactly once (the sim finishes it on the lifecycle's Finish)
    done_events = [e for e, ph in seen if ph is RequestPhase.DONE]
    assert len(done_events) == len(trace)
    assert {"RelayTokens", "MainTokens"} >= set(done_events)
    # every switch to MD was a cut (CutReady) and ended on MD's tokens (MainTokens)
    assert names.count("CutReady") >= s.switches > 0
    assert done_events.count("MainTokens") >= s.switches
    assert "MdReady" in names and s.requests == len(trace)


def test_the_lifecycles_actions_drive_the_sim(monkeypatch):
    """Make CutReady a no-op in the lifecycle (as it is when the request ends on RLD anyway)
    and no simulated request is handed to MD: the sim does what the lifecycle says."""
    from sglang_pdd.router.flow import lifecycle
    from sglang_pdd.sim.workload import generate_agentic_trace, realistic_agentic_config
    trace = list(generate_agentic_trace(realistic_agentic_config(num_requests=150, seed=2)))
    import dataclasses
    no_p_md = ScenarioConfig(**{**CFG.__dict__, "router": dataclasses.replace(
        Simulation(CFG, SLA).route_cfg, max_wan_transfer_ms=0.0)})  # no P->MD: it needs the cut too
    assert Simulation(no_p_md, SLA).run(trace).switches > 0
    _counting_transition(monkeypatch, drop=lifecycle.CutReady)
    sim = Simulation(no_p_md, SLA)
    s = sim.run(trace)
    assert s.requests == len(trace) and s.switches == 0 and "p_md" not in s.paths
    assert s.rld_token_share == pytest.approx(1 - len(trace) / sum(r.output_length for r in trace))  # P makes token 1
    assert sim.loop.pending() == 0


@pytest.mark.parametrize("late", [True, False], ids=["default", "registers_first"])
def test_sim_decides_on_the_index_estimate_then_on_mds_answer(late):
    """flow.py with P's control API: decide on the prefix index's estimate. By default every
    path keeps it (MD registers beside P); with --p-md-registers-first P->MD registers first (a
    round trip before P) and decides again on MD's exact prefix."""
    from sglang_pdd.sim.cluster import SimRequest
    full = list(range(117))  # 117 blocks of 512 tokens
    tr = TraceRequest(0.0, 60_000, 300, tuple(full))  # ~1 s of WAN uncached, more than the budget

    def request(sim, md_cached):
        sim.rld_flows[0] = 91  # 90 others: P->MD gets half the slack (~0.9 s)
        r = SimRequest(tr, 0.0)
        r.rld, r.md, r.md_cached = 0, 0, md_cached
        r.p, r.p_tok = 0, 1  # P holds the prompt: its prefill costs no budget
        sim.p_tokens[0] = 1
        return r
    sim = Simulation(dataclasses.replace(RELAY_FIRST, p_md_late=late), SLA)
    assert sim.route_cfg.p_md_registers_first is not late
    r = request(sim, 59_904)  # MD holds it, the index does not know yet
    assert sim.choose_path(r, full) is Path.P_RLD_MD and not r.reg_first
    sim.md_index.record_blocks(0, full)
    r = request(sim, 59_904)
    assert sim.choose_path(r, full) is Path.P_MD and r.reg_first is not late
    r = request(sim, 0)  # the index is stale: MD's answer moves it to P->RLD->MD, or P->MD ships it all
    assert sim.choose_path(r, full) is (Path.P_MD if late else Path.P_RLD_MD) and r.reg_first is not late


def test_the_sim_names_every_lifecycle_action_and_one_it_misses_fails_at_build(monkeypatch):
    """The sim performs the router's lifecycle through the kit's Driver: every action the
    lifecycle can produce has an entry (its step, nothing, or a refusal), and a table that
    lacks one stops the simulation from being built rather than skipping the action."""
    from sglang_pdd.router.flow import lifecycle as lc
    sim = Simulation(CFG, SLA)
    assert set(sim._request.table) == set(lc.Action.__args__)
    full = Simulation._lifecycle_actions

    def missing_one(self):
        table = full(self)
        del table[lc.WithdrawDestination]
        return table

    monkeypatch.setattr(Simulation, "_lifecycle_actions", missing_one)
    with pytest.raises(ValueError, match=r"misses \['WithdrawDestination'\]"):
        Simulation(CFG, SLA)


def test_an_action_the_sim_does_not_model_stops_the_run_instead_of_being_skipped():
    from sglang_pdd.handoff.policy import HandoffConfig
    from sglang_pdd.router.flow import lifecycle as lc
    sim = Simulation(CFG, SLA)
    r = SimRequest(TraceRequest(timestamp_ms=0.0, input_length=100, output_length=20, hash_ids=(1,)), 0.0)
    r.state = lc.RequestState(max_new=20, catch_up=HandoffConfig(catch_up_threshold_tokens=1))
    sim._event(0.0, r, lc.PathChosen(Path.P_RLD_MD))
    r.state = dataclasses.replace(r.state, emitted=10, md=lc.Md.READY)
    with pytest.raises(RuntimeError, match="SendCatchUpBatch"):
        sim._event(0.0, r, lc.CutReady())
