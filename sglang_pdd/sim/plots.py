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
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(p.scenario for p in points):
        pts = sorted((p for p in points if p.scenario == name), key=lambda p: p.target_hit)
        ax.plot([p.target_hit for p in pts], [p.throughput_rps for p in pts], marker="o", label=name)
    ax.set_xlabel("prefix hit rate of the trace")
    ax.set_ylabel("sustained requests/s (offered load above capacity)")
    ax.set_title("Throughput vs hit rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
