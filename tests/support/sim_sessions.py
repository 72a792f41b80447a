"""A session trace and a recording simulation shared by the simulator's arrival tests."""

from dataclasses import asdict

from sglang_pdd.sim.cluster import Simulation
from sglang_pdd.sim.hardware import TOY_A, TOY_B, LinkProfile
from sglang_pdd.sim.metrics import Sla
from sglang_pdd.sim.scenarios import ClusterSpec, standard_scenarios
from sglang_pdd.sim.workload import AgenticTraceConfig, generate_agentic_trace

# Sessions arriving faster than one P and one MD serve them: open loop, turns pile up behind
# their predecessors.
TRACE = list(generate_agentic_trace(AgenticTraceConfig(num_requests=300, seed=3, session_rate_per_s=1.5,
                                                       outlier_fraction=0.03)))
SLOW_WAN = LinkProfile("wan", gbps=5.0, one_way_latency_s=0.02, jitter_s=0.0)


def designs():
    return standard_scenarios(ClusterSpec(chip_a=TOY_A, chip_b=TOY_B, n_prefill=1, n_rld=1, n_md=1, wan=SLOW_WAN))


class Recorder(Simulation):
    """Keeps each request's trace entry, arrival and end."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    def _finish(self, t_done, r, rld_tokens):
        self.seen.append((r.tr, r.arrival, t_done))
        super()._finish(t_done, r, rld_tokens)


def same(a, b):
    """Summaries equal field by field (repr: NaN equals NaN)."""
    return repr(asdict(a)) == repr(asdict(b))


def run(cfg, trace, arrivals, rate_scale=1.0):
    sim = Recorder(cfg, Sla(), rate_scale)
    sim.run(trace, arrivals)
    assert len(sim.seen) == len(trace)
    return sim.seen


def by_session(seen):
    out = {}
    for tr, arrival, done in seen:
        if tr.session_id is not None:
            out.setdefault(tr.session_id, []).append((tr, arrival, done))
    return {s: sorted(v, key=lambda x: x[0].timestamp_ms) for s, v in out.items()}


def early_turns(seen):
    """Turns that arrived before the turn they extend had been answered."""
    return sum(1 for turns in by_session(seen).values() for prev, nxt in zip(turns, turns[1:])
               if nxt[1] < prev[2] - 1e-9)


def write_trace(path, trace):
    path.write_text("".join(tr.to_json() + "\n" for tr in trace))
    return str(path)
