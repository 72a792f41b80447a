"""MD's staging budget (--pdd-md-staging-mb), cancelled KV of finished requests, and handoffs
that wait for MD to have room: the simulator does what a real MD and router do."""

import math
from dataclasses import replace

import pytest

from sglang_pdd.handoff.policy import HandoffConfig, HandoffMode
from sglang_pdd.router.policy import Path, PathPolicyConfig
from sglang_pdd.sim.cluster import ScenarioConfig, Simulation
from sglang_pdd.sim.hardware import TOY_A, TOY_B, LinkProfile
from sglang_pdd.sim.workload import TraceRequest

INSTANT = LinkProfile("instant", gbps=math.inf, one_way_latency_s=0.0)
KVB = TOY_A.kv_bytes_per_token
# Every request crosses the WAN (no budget for P->MD, no outlier filter): P->RLD->MD.
RELAY = PathPolicyConfig(max_wan_transfer_ms=0.0, enable_outlier_filter=False)


def _cfg(wan, n_rld=1, **kw):
    return ScenarioConfig("pdd", "pdd", n_prefill=1, n_rld=n_rld, n_md=1, prefill_hw=TOY_A, rld_hw=TOY_A,
                          md_hw=TOY_B, wan=wan, rdma=INSTANT, drc=False,
                          handoff=HandoffConfig(fixed_mode=HandoffMode.ONE_SHOT), router=RELAY, **kw)


def _req(t_ms, blocks, out, base):
    return TraceRequest(t_ms, blocks * 512, out, tuple(range(base, base + blocks)))


class Watched(Simulation):
    """Records the most bytes MD's staging budget ever held."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.peak_staged = 0.0

    def _registered(self, now, r):
        self.peak_staged = max(self.peak_staged, self.md_staged[0])
        super()._registered(now, r)


def test_a_room_beyond_the_budget_is_refused_and_stays_on_rld():
    wan = LinkProfile("wan", gbps=1.0, one_way_latency_s=0.02)
    budget = 20 * 512 * KVB  # room for one 16-block prompt, not two
    trace = [_req(0.0, 16, 200, 0), _req(1.0, 16, 200, 100)]
    sim = Simulation(_cfg(wan, md_staging_bytes=budget))
    s = sim.run(trace)
    assert s.paths == {"p_rld_md": 1, "p_rld_only": 1}
    assert s.md_refused == 1
    # Only the admitted room crossed the WAN.
    assert sim.kv_link.bytes_sent + sim.kv_link.bytes_cancelled == pytest.approx(16 * 512 * KVB)
    # With room for both, neither is refused.
    s2 = Simulation(_cfg(wan, md_staging_bytes=2 * budget)).run(trace)
    assert s2.paths == {"p_rld_md": 2} and s2.md_refused == 0


def test_the_budget_bounds_kv_in_flight_and_how_late_it_lands():
    # A WAN far too slow for the offered KV: without a bound every request's KV queues on
    # it and lands long after the trace; with one, the excess stays on RLD.
    wan = LinkProfile("wan", gbps=0.5, one_way_latency_s=0.02)
    trace = [_req(200.0 * i, 8, 400, 100 * i) for i in range(200)]
    budget = 4 * 8 * 512 * KVB
    bounded = Watched(_cfg(wan, md_staging_bytes=budget, keep_finished_kv=True))
    sb = bounded.run(trace)
    unbounded = Simulation(_cfg(wan, md_staging_bytes=math.inf, keep_finished_kv=True))
    su = unbounded.run(trace)
    assert bounded.peak_staged <= budget
    assert sb.md_refused > 0 and su.md_refused == 0
    assert sb.wan_gb < su.wan_gb
    span = trace[-1].timestamp_ms / 1e3
    assert unbounded.loop.now > 3 * span  # KV still landing long after the trace
    assert bounded.loop.now < 1.5 * span


def test_without_rld_registrations_wait_for_room():
    wan = LinkProfile("wan", gbps=1.0, one_way_latency_s=0.02)
    budget = 10 * 512 * KVB  # one 8-block room at a time
    trace = [_req(0.0, 8, 4, 0), _req(1.0, 8, 4, 100), _req(2.0, 30, 4, 200)]  # the last exceeds the budget
    sim = Watched(_cfg(wan, n_rld=0, md_staging_bytes=budget))
    s = sim.run(trace)
    assert s.paths == {"p_md": 3} and s.md_refused == 0  # nothing to fall back on: all served by MD
    one_room_s = 8 * 512 * KVB / wan.bytes_per_s
    # The second prefill starts only after the first room landed, so its TTFT pays one
    # room's transfer more than the first's.
    ttft = list(sim.log.ttft)
    assert ttft[1] > ttft[0] + 0.8 * one_room_s
    assert sim.peak_staged <= 30 * 512 * KVB  # the oversized room went alone


def test_kv_kept_for_the_cache_gives_its_budget_to_a_request_that_waits_for_it():
    # Short answers end on RLD long before their KV crosses a slow WAN. Kept (the default) it
    # goes on landing for the next turn, but gives up MD's staging budget to the next
    # request's room, which a request waits for: admitted, never refused for it. Cancelled
    # (the what-if), it frees the budget at once.
    wan = LinkProfile("wan", gbps=0.2, one_way_latency_s=0.02)
    budget = 10 * 512 * KVB
    trace = [_req(2000.0 * i, 8, 3, 100 * i) for i in range(10)]
    cancel = Simulation(_cfg(wan, md_staging_bytes=budget, keep_finished_kv=False)).run(trace)
    assert cancel.md_refused == 0 and cancel.paths == {"p_rld_md": 10}
    assert cancel.wan_cancelled_gb > 0.5 * 10 * 8 * 512 * KVB / 1e9
    assert (cancel.kv_cancelled, cancel.kv_kept) == (10, 0)
    sim = Simulation(replace(_cfg(wan, md_staging_bytes=budget), drc=True))
    kept = sim.run(trace)
    assert kept.md_refused == 0 and kept.paths == {"p_rld_md": 10}
    assert kept.kv_kept == 10 and kept.kv_kept_dropped == 9  # each next room took the last one's budget
    assert kept.kv_kept_landed == 1 and kept.kv_cancelled == 9  # the last one landed
    assert not any(sim.md_kept) or all(not k for k in sim.md_kept)


def test_handoff_waits_until_md_can_admit():
    # MD runs one sequence at a time. B's KV lands while A decodes on MD: B must keep
    # decoding on RLD (no stall in MD's queue) and move once A has finished.
    md = replace(TOY_B, max_running_requests=1)
    wan = LinkProfile("wan", gbps=100.0, one_way_latency_s=0.01)
    cfg = replace(_cfg(wan, md_staging_bytes=math.inf), md_hw=md)
    a, b = _req(0.0, 2, 2000, 0), _req(500.0, 2, 6000, 100)  # B outlasts A on RLD
    sim = Simulation(cfg)
    moved = {}
    orig = sim._handoff_round

    def spy(now, r):
        moved.setdefault(r.tr.hash_ids[0], now)
        orig(now, r)

    sim._handoff_round = spy
    s = sim.run([a, b])
    assert s.paths == {"p_rld_md": 2}
    a_done = sim.log.arrival[0] + sim.log.e2e[0]
    assert moved[100] >= a_done - 0.02  # B's handoff began only when A's slot freed (A's stream latency)
    # B's switch stall is one handoff, not a wait behind A in MD's queue.
    assert sim.log.stall[1] < 1.0
    # B decoded on RLD meanwhile.
    assert sim.log.rld_tokens[1] > 0


def test_can_admit_is_what_admission_does():
    from sglang_pdd.sim.engine import EventLoop
    from sglang_pdd.sim.servers import DecodeInstance
    hw = replace(TOY_B, max_running_requests=2, kv_capacity_tokens=1000)
    loop = EventLoop()
    d = DecodeInstance(loop, hw, lambda *_: None, lambda *_: None)
    assert d.can_admit(5000)  # an empty instance takes anything (as _admit does)
    d.submit(0.0, "x", 100, 600)
    assert d.can_admit(300) and not d.can_admit(301)
    d.submit(0.0, "y", 100, 200)
    assert not d.can_admit(1)  # batch full


def test_a_room_that_shrinks_at_transfer_start_lets_waiters_in():
    # No RLD. Request 2 repeats request 1's prompt: registered while MD's cache was empty, it
    # finds the whole prompt cached by the time P is done and ships nothing, so its budget
    # comes back at transfer start, where request 3 (waiting behind it) must be let in;
    # waiting for a landing that frees nothing left it stuck for ever.
    wan = LinkProfile("wan", gbps=1.0, one_way_latency_s=0.02)
    trace = [_req(0.0, 16, 4, 0), _req(1.0, 16, 4, 0), _req(2.0, 8, 4, 100)]
    cfg = replace(_cfg(wan, n_rld=0, md_staging_bytes=17 * 512 * KVB), drc=True)
    s = Simulation(cfg).run(trace)
    assert s.requests == 3 and s.paths == {"p_md": 3}
