"""One set of rules for every design: the same P placement (router/backends/placement.py's
pick_prefill, what the router runs), the same MD staging budget and admission, charged when a
transfer starts, for every design that lands KV on MD, and the WAN's lease in every
cross-datacenter design's cost."""

import math
from dataclasses import replace

import pytest

from sglang_pdd.config import md_staging_bytes
from sglang_pdd.router.backends import placement
from sglang_pdd.router.policy import Path, PathMode
from sglang_pdd.sim.cluster import Simulation
from sglang_pdd.sim.hardware import TOY_A, TOY_B, LinkProfile
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios
from sglang_pdd.sim.workload import TraceRequest

SPEC = ClusterSpec(chip_a=TOY_A, chip_b=TOY_B, n_prefill=3, n_rld=1, n_md=2)
DESIGNS = [c.name for c in standard_scenarios(SPEC)]
SLA = Sla(ttft_s=5.0, tpot_s=0.1)


def _sessions(n_sessions=6, turns=4, gap_ms=400.0, blocks=8):
    """Interleaved sessions; each turn extends its previous one by a block."""
    out, t = [], 0.0
    for k in range(turns):
        for s in range(n_sessions):
            base = 1000 * s
            ids = tuple(range(base, base + blocks + k))
            out.append(TraceRequest(t, len(ids) * 512, 40, ids, s, k))
            t += gap_ms
    return out


def test_every_design_places_p_with_the_routers_rule(monkeypatch):
    """Every design's P is placement.pick_prefill's answer (a spy on the router's function),
    and with requests far enough apart that no queue differs, every design puts each
    request on the same P."""
    calls = {}
    real = placement.pick_prefill

    def spy(loads, owner, held):
        calls[current[0]] = calls.get(current[0], 0) + 1
        return real(loads, owner, held)
    monkeypatch.setattr(placement, "pick_prefill", spy)
    current = [None]
    trace = _sessions(gap_ms=20_000.0)  # each request done before the next arrives
    choices = {}
    for cfg in standard_scenarios(SPEC):
        current[0] = cfg.name
        sim = Simulation(cfg, SLA)
        picked = []
        orig = sim._place_p
        sim._place_p = lambda full, orig=orig: picked.append(orig(full)) or picked[-1]
        sim.run(trace)
        choices[cfg.name] = picked
    assert set(calls) == set(DESIGNS)  # the router's function placed P in every design
    assert all(calls[n] > 0 for n in DESIGNS)
    first = choices[DESIGNS[0]]
    assert len(set(first)) > 1  # sessions spread over the P...
    assert all(choices[n] == first for n in DESIGNS)  # ...and alike in every design


def test_p_is_placed_by_prefill_tokens_in_flight_in_every_design():
    """Two P: a long prompt queued on P0 (its tokens in flight), then a new session: every
    design sends it to P1; a prompt whose prefix P0 holds stays on P0 while P0's queue is no
    longer than that prefix."""
    for cfg in standard_scenarios(replace(SPEC, n_prefill=2)):
        sim = Simulation(cfg, SLA)
        sim.p_tokens[0] = 10 * 512
        assert sim._place_p(tuple(range(500, 508))) == 1, cfg.name
        sim.p_index.record_blocks(0, tuple(range(100, 120)))  # P0 holds 20 blocks of this prefix
        assert sim._place_p(tuple(range(100, 124))) == 0, cfg.name  # 10 blocks queued < 20 held
        sim.p_tokens[0] = 21 * 512
        assert sim._place_p(tuple(range(100, 124))) == 1, cfg.name  # the queue outweighs the prefix


class Charged(Simulation):
    """Records, per request, when MD's staging budget was charged and when its prefill ended,
    and the most the budget ever held."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prefilled, self.charged, self.peak = {}, {}, 0.0

    def _prefill_done(self, now, r):
        self.prefilled[id(r)] = now
        super()._prefill_done(now, r)

    def _send_kv(self, now, r):
        if self.cfg.md_remote:
            self.charged[id(r)] = now
            self.peak = max(self.peak, max(self.md_staged))
        super()._send_kv(now, r)


def test_every_design_that_lands_kv_on_md_has_the_same_budget_charged_at_transfer_start():
    budget = 3 * 8 * 512 * TOY_A.kv_bytes_per_token  # three 8-block rooms
    spec = replace(SPEC, md_staging_mb=budget / 2 ** 20, n_prefill=1, n_md=1,
                   wan=LinkProfile("wan", gbps=2.0, one_way_latency_s=0.02))
    # a burst of fresh 8-block prompts: P's queue is long, the WAN slow
    trace = [TraceRequest(10.0 * i, 8 * 512, 400, tuple(range(100 * i, 100 * i + 8))) for i in range(24)]
    for cfg in standard_scenarios(spec):
        sim = Charged(cfg, SLA)
        s = sim.run(trace)
        assert s.requests == len(trace)
        if not cfg.md_remote:  # same-DC PD: KV over RDMA into D, no staging
            assert sim.charged == {} and s.staging_gb == 0
            continue
        assert sim.staging_bytes == pytest.approx(budget), cfg.name
        assert sim.charged, cfg.name
        # charged when the transfer starts: never before the request's prefill ended
        assert all(t >= sim.prefilled[k] - 1e-12 for k, t in sim.charged.items()), cfg.name
        assert sim.peak <= budget * (1 + 1e-9), cfg.name
        # the burst did not fit: without an RLD the transfers waited; P->RLD->MD ones were refused
        assert s.md_waited + s.md_refused > 0, cfg.name
        if cfg.kind == "xdc":
            assert s.md_refused == 0 and s.paths == {"p_md": len(trace)}
        assert not any(sim.md_staged) and not any(sim.md_send_wait)  # all given back


def test_the_default_budget_is_the_real_mds_share_of_its_pool_in_every_design():
    for cfg in standard_scenarios(SPEC):
        if cfg.md_remote:
            want = md_staging_bytes(0, cfg.md_hw.kv_capacity_tokens, cfg.md_hw.kv_bytes_per_token)
            assert cfg.staging_bytes == pytest.approx(want)
            assert cfg.staging_bytes > 4 * 2 ** 30  # not the old fixed 4 GiB


def test_a_p_rld_md_room_refused_at_transfer_start_stays_on_rld():
    # the budget holds one room; two P->RLD->MD requests' transfers start together
    spec = replace(SPEC, n_prefill=2, n_md=1, md_staging_mb=10 * 512 * TOY_A.kv_bytes_per_token / 2 ** 20,
                   wan=LinkProfile("wan", gbps=1.0, one_way_latency_s=0.02), rld_max_running=10 ** 6,
                   path_mode=PathMode.RELAY_FIRST)  # both through the idle RLD
    cfg = {c.name: c for c in standard_scenarios(spec)}["pdd_drc_oneshot"]
    trace = [TraceRequest(0.0, 8 * 512, 400, tuple(range(8))), TraceRequest(0.0, 8 * 512, 400, tuple(range(50, 58)))]
    sim = Simulation(cfg, SLA)
    s = sim.run(trace)
    assert s.md_refused == 1 and s.paths == {"p_rld_md": 1, "p_rld_only": 1}
    assert s.kv_landed == 1 and list(sim.log.rld_tokens).count(399) == 1  # RLD decoded the refused one whole
