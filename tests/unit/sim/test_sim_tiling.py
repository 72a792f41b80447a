"""A tiled trace is K populations of users: spread across the trace (the default) a burst of
the trace arrives once, not K times at once; lockstep (a what-if) stacks the copies' bursts.
Each copy keeps its sessions whole, and the rate is K times the trace's."""

import json
import random
import pytest

from sglang_pdd.sim.cli import main
from sglang_pdd.sim.sizing import offered_rps
from sglang_pdd.sim.traces import tile_trace
from sglang_pdd.sim.workload import TraceRequest, generate_agentic_trace, report_agentic_config


def _bursty(n_bursts=15, burst=12, between=30, seed=5):
    """Bursts of `burst` requests within 50 ms at random times over an hour, `between` lone
    requests per burst at random times: the shape of the Mooncake trace's peaks."""
    rng = random.Random(seed)
    out, ids = [], 0

    def req(t):
        nonlocal ids
        ids += 4
        return TraceRequest(t, 2048, 8, tuple(range(ids - 4, ids)))

    for _ in range(n_bursts):
        t = rng.uniform(0, 3_600_000)
        out += [req(t + rng.uniform(0, 50)) for _ in range(burst)]
        out += [req(rng.uniform(0, 3_600_000)) for _ in range(between)]
    return sorted(out, key=lambda r: r.timestamp_ms)


def _mean_gap(trace):
    return (trace[-1].timestamp_ms - trace[0].timestamp_ms) / (len(trace) - 1)


def _peak(trace, window):
    """Most arrivals within any window of that length (ms)."""
    ts = [r.timestamp_ms for r in trace]
    best, lo = 0, 0
    for hi, t in enumerate(ts):
        while ts[lo] < t - window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def test_spread_copies_do_not_stack_their_bursts():
    base = _bursty()
    gap = _mean_gap(base)
    peak = _peak(base, gap)
    tiled = tile_trace(base, 4)
    spread = _peak(tiled, gap)
    # the copies' bursts fall at different times: a burst and the other copies' background
    assert spread < 1.5 * peak
    lockstep = _peak(tile_trace(base, 4, "lockstep"), gap)
    assert lockstep >= 4 * 12 and lockstep > 2 * spread  # every burst four times at once
    # the rate is four times the trace's, over the same span
    assert len(tiled) == 4 * len(base)
    assert offered_rps(tiled) == pytest.approx(4 * offered_rps(base), rel=1e-3)


def test_spread_copies_keep_their_sessions_whole_and_start_k_times_as_many():
    base = list(generate_agentic_trace(report_agentic_config(num_requests=600, seed=2)))
    tiled = tile_trace(base, 3)
    assert tiled == tile_trace(base, 3)  # deterministic
    assert [r.timestamp_ms for r in tiled] == sorted(r.timestamp_ms for r in tiled)
    n_sessions = 1 + max(r.session_id for r in base)

    def sessions(trace):
        out = {}
        for r in trace:
            out.setdefault(r.session_id, []).append(r)
        return out

    orig = sessions(base)
    copies = sessions(tiled)
    assert len(copies) == 3 * len(orig)
    offsets = set()
    for sid, turns in copies.items():
        src = orig[sid % n_sessions]
        # the same turns in the same order, every gap kept, the whole session moved by one offset
        assert [(r.input_length, r.output_length, r.turn) for r in turns] == \
            [(r.input_length, r.output_length, r.turn) for r in src]
        shifts = [a.timestamp_ms - b.timestamp_ms for a, b in zip(turns, src)]
        assert max(shifts) - min(shifts) < 1e-6
        if sid < n_sessions:
            assert shifts[0] == 0.0  # the first copy is the trace itself
        offsets.add(round(shifts[0]))
    assert len(offsets) > 3  # wrapped sessions move back, the others forward
    # session starts: three times the trace's, all within the trace's period
    t0 = base[0].timestamp_ms
    span = base[-1].timestamp_ms - t0
    starts = sorted(turns[0].timestamp_ms - t0 for turns in copies.values())
    assert starts[0] >= 0.0 and starts[-1] < span * (1 + 1 / (len(base) - 1)) + 1e-6


def test_cli_names_the_tiling_in_its_summary_and_json(tmp_path, capsys):
    for mode in ("spread", "lockstep"):
        rc = main(["compare", "--agentic", "80", "--tile", "2", "--tile-mode", mode, "--prefill", "1", "--md", "1",
                   "--out", str(tmp_path)])
        assert rc == 0
        head = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("# "))
        assert f"tiled 2x {mode}" in head
        name = "agentic80x2" + ("" if mode == "spread" else "lockstep")
        rows = json.loads((tmp_path / f"compare_{name}.json").read_text())
        assert {(r["setup"]["tile"], r["setup"]["tile_mode"]) for r in rows} == {(2, mode)}


def test_a_seed_draws_where_the_copies_sit_and_seed_0_keeps_the_even_offsets():
    from sglang_pdd.sim.cli import _add_common, seed_effect
    import argparse
    base = [TraceRequest(t * 1000.0, 100, 10, (t,)) for t in range(20)]
    even = tile_trace(base, 4, "spread")
    assert tile_trace(base, 4, "spread", seed=0) == even
    one, two = tile_trace(base, 4, "spread", seed=1), tile_trace(base, 4, "spread", seed=2)
    assert sorted(r.timestamp_ms for r in one) != sorted(r.timestamp_ms for r in even)
    assert sorted(r.timestamp_ms for r in one) != sorted(r.timestamp_ms for r in two)
    # the same requests, only placed differently
    assert sorted(r.hash_ids for r in one) == sorted(r.hash_ids for r in even)
    assert tile_trace(base, 4, "spread", seed=1) == one
    p = argparse.ArgumentParser()
    _add_common(p)
    assert "draws where the 4 copies" in seed_effect(p.parse_args(["--trace", "x.jsonl", "--tile", "4"]))
    assert "only the WAN's jitter" in seed_effect(p.parse_args(["--trace", "x.jsonl"]))
