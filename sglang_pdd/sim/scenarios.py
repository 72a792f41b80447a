"""The standard comparison: same trace, same prefill fleet, different decode designs.

Baselines get the same number of decode instances as PDD's RLD + MD, so the table shows
both what each design costs and what it delivers; BCR puts the two on one axis.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

from sglang_pdd.handoff.policy import HandoffConfig, HandoffMode

from .cluster import ScenarioConfig
from .hardware import CHIP_A, CHIP_B, RDMA_DEFAULT, WAN_DEFAULT, HardwareProfile, LinkProfile


@dataclass(frozen=True)
class ClusterSpec:
    # PD's sized mix for the realistic agentic trace with the default Llama-3-70B presets
    # (7 P, 4 D at 90% SLA attainment, docs/sim.md); PDD splits the 4 decoders 1 RLD + 3 MD.
    n_prefill: int = 7
    n_rld: int = 1
    n_md: int = 3
    chip_a: HardwareProfile = CHIP_A  # datacenter A: prefill, relay decode, PD's decode
    chip_b: HardwareProfile = CHIP_B  # datacenter B: main decode
    wan: LinkProfile = WAN_DEFAULT
    rdma: LinkProfile = RDMA_DEFAULT
    catch_up_threshold_tokens: int = 64
    md_staging_mb: float = 4096  # MD's --pdd-md-staging-mb
    keep_finished_kv: bool = False  # KV of a request that ended on RLD still lands in the DRC
    # RLD's own hardware (any chip count, e.g. preset(model, "h100", 3)); None: chip_a.
    rld_hw: Optional[HardwareProfile] = None
    # PDD's P placement: None = the router's (flows in flight + prefix index), True = the
    # baselines' cache-aware rule, False = round robin (what-ifs).
    p_affinity: Optional[bool] = None
    seed: int = 0


def pdd(spec: ClusterSpec, name: str, drc: bool, mode: "HandoffMode | None") -> ScenarioConfig:
    return ScenarioConfig(
        name=name, kind="pdd", n_prefill=spec.n_prefill, n_rld=spec.n_rld, n_md=spec.n_md,
        prefill_hw=spec.chip_a, rld_hw=spec.rld_hw or spec.chip_a, md_hw=spec.chip_b, wan=spec.wan,
        rdma=spec.rdma, p_affinity=spec.p_affinity,
        drc=drc, handoff=HandoffConfig(catch_up_threshold_tokens=spec.catch_up_threshold_tokens, fixed_mode=mode),
        md_staging_bytes=spec.md_staging_mb * 2 ** 20, keep_finished_kv=spec.keep_finished_kv, seed=spec.seed)


def standard_scenarios(spec: ClusterSpec) -> List[ScenarioConfig]:
    n_decode = spec.n_rld + spec.n_md
    return [
        ScenarioConfig(name="pd_same_dc", kind="pd", n_prefill=spec.n_prefill, n_md=n_decode,
                       prefill_hw=spec.chip_a, md_hw=spec.chip_a, wan=spec.wan, rdma=spec.rdma,
                       drc=False, seed=spec.seed),
        ScenarioConfig(name="naive_xdc", kind="naive", n_prefill=spec.n_prefill, n_md=n_decode,
                       prefill_hw=spec.chip_a, md_hw=spec.chip_b, wan=spec.wan, rdma=spec.rdma,
                       drc=False, seed=spec.seed),
        pdd(spec, "pdd_nodrc_oneshot", drc=False, mode=HandoffMode.ONE_SHOT),
        pdd(spec, "pdd_drc_oneshot", drc=True, mode=HandoffMode.ONE_SHOT),
        pdd(spec, "pdd_drc_catchup", drc=True, mode=HandoffMode.CATCH_UP),
        pdd(spec, "pdd_drc_adaptive", drc=True, mode=None),
    ]


def with_counts(cfg: ScenarioConfig, n_prefill: int, n_rld: int, n_md: int) -> ScenarioConfig:
    if cfg.kind != "pdd":
        return replace(cfg, n_prefill=n_prefill, n_md=n_md + n_rld)
    return replace(cfg, n_prefill=n_prefill, n_rld=n_rld, n_md=n_md)
