"""The soak's timeline as a PNG: each request's latency at the time it was sent (completed
equal, failed with a documented status, anything else), the faults shaded where they were on."""

from __future__ import annotations

from pathlib import Path

from sglang_pdd.chaos.checks import explained
from sglang_pdd.chaos.spec import FaultKind

_COLORS = {FaultKind.KILL_RLD: "#d62728", FaultKind.KILL_MD: "#9467bd", FaultKind.KILL_P: "#8c564b",
           FaultKind.WAN_DOWN: "#1f77b4", FaultKind.WAN_SLOW: "#17becf", FaultKind.ROUTER_RESTART: "#7f7f7f",
           FaultKind.MD_DRAIN: "#bcbd22", FaultKind.MD_SLOW: "#ff7f0e", FaultKind.MD_STOP: "#e377c2"}


def timeline(outcome, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4.5))
    seen = set()
    for f in outcome.fired:
        label = f.kind.value if f.kind not in seen else None
        seen.add(f.kind)
        ax.axvspan(f.started_s, max(f.recovered_s, f.started_s + 0.5), color=_COLORS[f.kind], alpha=0.25, label=label)
    groups = {"completed, output equal": ([], [], "o", "#2ca02c"),
              "failed with a documented status": ([], [], "x", "#d62728"),
              "unequal or undocumented": ([], [], "D", "black")}
    for r in outcome.records:
        ok = r.completed and list(r.received) == list(outcome.references[r.key]) and not r.breaks
        key = ("completed, output equal" if ok else
               "failed with a documented status" if not r.completed and explained(r, outcome.fired)
               else "unequal or undocumented")
        groups[key][0].append(r.sent_s)
        groups[key][1].append(max(r.ended_s - r.sent_s, 1e-3))
    for label, (xs, ys, marker, color) in groups.items():
        if xs:
            ax.scatter(xs, ys, s=10, marker=marker, color=color, label=f"{label} ({len(xs)})")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the load started")
    ax.set_ylabel("request latency (s, log)")
    row = outcome.row
    ax.set_title(f"{row.name}: {row.requests} requests, {sum(row.faults.values())} faults; "
                 f"{row.completed_equal} completed equal, {sum(row.failed.values())} failed with status, "
                 f"{row.duplicated} duplicated, {row.skipped} skipped, {len(row.leaks)} leaks")
    ax.legend(loc="upper left", fontsize=7, ncol=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
