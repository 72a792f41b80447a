"""PNG plots of a comparison and of the bathtub sweep (matplotlib, headless)."""

from __future__ import annotations

import os
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .bathtub import BathtubPoint  # noqa: E402
from .metrics import Summary  # noqa: E402


def plot_comparison(summaries: Sequence[Summary], title: str, path: str) -> str:
    names = [s.scenario for s in summaries]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].bar(names, [s.bcr for s in summaries], color="tab:green")
    axes[0].set_title("BCR (SLA requests per $)")
    x = range(len(names))
    for q, key in (("p50", "ttft_p50"), ("p90", "ttft_p90"), ("p99", "ttft_p99")):
        axes[1].plot(x, [getattr(s, key) for s in summaries], marker="o", label=q)
    axes[1].set_yscale("log")
    axes[1].set_title("TTFT (s)")
    axes[1].legend()
    axes[2].bar(names, [s.wan_gb for s in summaries], color="tab:orange")
    axes[2].set_title("WAN GB")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bathtub(points: Sequence[BathtubPoint], path: str) -> str:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name in dict.fromkeys(p.scenario for p in points):
        pts = sorted((p for p in points if p.scenario == name), key=lambda p: p.target_hit)
        line, = ax.plot([p.target_hit for p in pts], [p.goodput_rps for p in pts], marker="o",
                        label=f"{name}: goodput within SLA")
        c = line.get_color()
        ax.plot([p.target_hit for p in pts], [p.throughput_rps for p in pts], ls=":", color=c,
                label=f"{name}: saturation throughput")
        ax2.plot([p.target_hit for p in pts], [p.prefill_util for p in pts], color=c, marker="o",
                 label=f"{name}: prefill busy")
        if any(p.wan_util > 0 for p in pts):
            ax2.plot([p.target_hit for p in pts], [p.wan_util for p in pts], color=c, ls="--", marker="x",
                     label=f"{name}: WAN util")
    for a_ in (ax, ax2):
        a_.set_xlabel("target prefix hit rate (realised: whole 512-token blocks)")
        a_.grid(alpha=0.3)
        a_.legend(fontsize=7)
    ax.set_ylabel("steady-state requests/s (closed loop)")
    ax.set_title("Goodput within the SLA vs hit rate")
    ax2.set_ylabel("busy fraction")
    ax2.set_title("Which resource binds")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_load_sweep(knees, title: str, path: str) -> str:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for k in knees:
        xs = [p.offered_rps for p in k.points]
        line, = ax.plot(xs, [p.goodput_rps for p in k.points], marker="o", label=f"{k.scenario} (${k.cost_per_hour:.0f}/h)")
        ax2.plot(xs, [100 * p.sla_attainment for p in k.points], marker="o", color=line.get_color(), label=k.scenario)
        if k.knee is not None:
            ax.plot([k.knee.offered_rps], [k.knee.goodput_rps], marker="*", ms=16, color=line.get_color())
    lim = max(p.offered_rps for k in knees for p in k.points)
    ax.plot([0, lim], [0, lim], ls=":", color="grey", label="goodput = offered")
    ax.set_xlabel("offered requests/s")
    ax.set_ylabel("goodput (SLA-meeting requests/s)")
    ax.set_title("goodput vs offered load (star: knee)")
    ax2.set_xlabel("offered requests/s")
    ax2.set_ylabel("SLA attainment %")
    for a_ in (ax, ax2):
        a_.grid(alpha=0.3)
        a_.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
