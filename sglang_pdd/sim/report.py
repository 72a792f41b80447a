"""Plain-text tables of run summaries."""

from __future__ import annotations

from dataclasses import asdict
from typing import Iterable, List

from .metrics import Summary

COLUMNS = [
    ("scenario", "{:<20}", "scenario"),
    ("$/h", "{:>6.0f}", "cost_per_hour"),
    ("TTFT p50", "{:>8.2f}", "ttft_p50"),
    ("p90", "{:>6.2f}", "ttft_p90"),
    ("p99", "{:>6.2f}", "ttft_p99"),
    ("TPOT p50 ms", "{:>11.1f}", "tpot_p50"),
    ("p90", "{:>6.1f}", "tpot_p90"),
    ("p99", "{:>6.1f}", "tpot_p99"),
    ("stall p99 ms", "{:>12.0f}", "stall_p99"),
    ("ITL p99 ms", "{:>10.0f}", "itl_p99"),
    ("SLA%", "{:>6.1f}", "sla_attainment"),
    ("good r/s", "{:>8.2f}", "goodput_rps"),
    ("WAN GB", "{:>7.0f}", "wan_gb"),
    ("WAN util", "{:>8.2f}", "wan_util"),
    ("MD hit", "{:>6.2f}", "mean_md_hit"),
    ("KV landed GB", "{:>12.0f}", "wan_landed_gb"),
    ("cancelled GB", "{:>12.0f}", "wan_cancelled_gb"),
    ("refused", "{:>7d}", "md_refused"),
    ("RLD tok%", "{:>8.1f}", "rld_token_share"),
    ("BCR", "{:>7.1f}", "bcr"),
]
_SCALE = {"tpot_p50": 1e3, "tpot_p90": 1e3, "tpot_p99": 1e3, "stall_p99": 1e3, "itl_p99": 1e3, "sla_attainment": 100.0, "rld_token_share": 100.0}


def format_table(summaries: Iterable[Summary]) -> str:
    rows = []
    for s in summaries:
        d = asdict(s)
        rows.append([fmt.format(d[key] * _SCALE[key] if key in _SCALE else d[key]) for _, fmt, key in COLUMNS])
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, (h, _, _) in enumerate(COLUMNS)]
    lines: List[str] = ["  ".join(h.rjust(w) if i else h.ljust(w)
                                  for i, ((h, _, _), w) in enumerate(zip(COLUMNS, widths)))]
    for r in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines.append("TTFT in s. $/h = hardware + the WAN's lease for a cross-datacenter design; BCR = SLA-meeting "
                 "requests per $ of that (higher is better). Egress $ and the split are in the JSON.")
    return "\n".join(lines)
