"""The standard comparison: same trace, same prefill fleet, different decode designs.

The designs (`DESIGNS`), every one under the same rules (one P placement, one MD placement,
one MD staging and admission for every design that lands KV on MD, the WAN's lease in every
cross-datacenter design's cost):

- `pd_same_dc`: P and D in one datacenter on chip A, KV over RDMA;
- `xdc_pd`: cross-datacenter PD, P (chip A) -> MD (chip B) over the WAN for every request,
  no relay, no decode-side cache;
- `xdc_pd_drc`: the same with MD's decode-side radix cache (only the uncached suffix
  crosses);
- `pdd_*`: the PDD router (P -> MD, P -> RLD -> MD, P -> RLD) with or without DRC and a
  fixed or load-following handoff mode.

Baselines get the same number of decode instances as PDD's RLD + MD, so the table shows
both what each design costs and what it delivers; BCR puts the two on one axis.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

from sglang_pdd.handoff.policy import HandoffConfig, HandoffMode
from sglang_pdd.router.policy import RLD_MAX_RUNNING_DEFAULT, PathMode

from .cluster import ScenarioConfig
from .hardware import CHIP_A, CHIP_B, RDMA_DEFAULT, WAN_DEFAULT, HardwareProfile, LinkProfile

# The baselines every PDD verdict is stated against, in the order `size` prints them.
BASELINES = ("pd_same_dc", "xdc_pd", "xdc_pd_drc")
DESIGN_LABELS = {
    "pd_same_dc": "same-DC PD",
    "xdc_pd": "cross-DC PD (no relay, no DRC)",
    "xdc_pd_drc": "cross-DC PD + DRC",
    "pdd_drc_adaptive": "PDD",
}


@dataclass(frozen=True)
class ClusterSpec:
    # PD's sized mix for the realistic agentic trace with the default Llama-3-70B presets
    # (7 P, 4 D at 90% SLA attainment in round 3, docs/sim-notebook.md); PDD splits the 4
    # decoders 1 RLD + 3 MD. Defaults for quick runs, not a sized fleet.
    n_prefill: int = 7
    n_rld: int = 1
    n_md: int = 3
    chip_a: HardwareProfile = CHIP_A  # datacenter A: prefill, relay decode, PD's decode
    chip_b: HardwareProfile = CHIP_B  # datacenter B: main decode
    wan: LinkProfile = WAN_DEFAULT
    rdma: LinkProfile = RDMA_DEFAULT
    catch_up_threshold_tokens: int = 64
    # MD's --pdd-md-staging-mb; None: the real MD's default (a share of MD's KV pool)
    md_staging_mb: Optional[float] = None
    rld_max_running: int = RLD_MAX_RUNNING_DEFAULT  # the router's --rld-max-running
    path_mode: PathMode = PathMode.FIT  # the router's --path-mode
    keep_finished_kv: bool = True  # KV of a request that ended on RLD still lands in the DRC
    # RLD's own hardware (any chip count, e.g. preset(model, "h100", 3)); None: chip_a.
    rld_hw: Optional[HardwareProfile] = None
    p_placement: str = "router"  # every design's P rule (what-ifs: flows, backlog, round_robin)
    seed: int = 0

    @property
    def staging_bytes(self) -> Optional[float]:
        return None if self.md_staging_mb is None else self.md_staging_mb * 2 ** 20


def _common(spec: ClusterSpec) -> dict:
    return dict(n_prefill=spec.n_prefill, prefill_hw=spec.chip_a, wan=spec.wan, rdma=spec.rdma,
                p_placement=spec.p_placement, md_staging_bytes=spec.staging_bytes, seed=spec.seed)


def pdd(spec: ClusterSpec, name: str, drc: bool, mode: "HandoffMode | None") -> ScenarioConfig:
    return ScenarioConfig(
        name=name, kind="pdd", n_rld=spec.n_rld, n_md=spec.n_md, rld_hw=spec.rld_hw or spec.chip_a,
        md_hw=spec.chip_b, drc=drc,
        handoff=HandoffConfig(catch_up_threshold_tokens=spec.catch_up_threshold_tokens, fixed_mode=mode),
        rld_max_running=spec.rld_max_running, path_mode=spec.path_mode, keep_finished_kv=spec.keep_finished_kv,
        **_common(spec))


def standard_scenarios(spec: ClusterSpec) -> List[ScenarioConfig]:
    n_decode = spec.n_rld + spec.n_md
    return [
        ScenarioConfig(name="pd_same_dc", kind="pd", n_md=n_decode, md_hw=spec.chip_a, drc=False, **_common(spec)),
        ScenarioConfig(name="xdc_pd", kind="xdc", n_md=n_decode, md_hw=spec.chip_b, drc=False, **_common(spec)),
        ScenarioConfig(name="xdc_pd_drc", kind="xdc", n_md=n_decode, md_hw=spec.chip_b, drc=True, **_common(spec)),
        pdd(spec, "pdd_nodrc_oneshot", drc=False, mode=HandoffMode.ONE_SHOT),
        pdd(spec, "pdd_drc_oneshot", drc=True, mode=HandoffMode.ONE_SHOT),
        pdd(spec, "pdd_drc_catchup", drc=True, mode=HandoffMode.CATCH_UP),
        pdd(spec, "pdd_drc_adaptive", drc=True, mode=None),
    ]


def with_counts(cfg: ScenarioConfig, n_prefill: int, n_rld: int, n_md: int) -> ScenarioConfig:
    if cfg.kind != "pdd":
        return replace(cfg, n_prefill=n_prefill, n_md=n_md + n_rld)
    return replace(cfg, n_prefill=n_prefill, n_rld=n_rld, n_md=n_md)
