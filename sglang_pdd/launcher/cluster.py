"""Bring a local PDD topology up and down: real SGLang servers, the router, per-process logs."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from sglang_pdd.launcher.netns import netns_exec_argv
from sglang_pdd.launcher.processes import ClusterProcesses, ProcessGroup
from sglang_pdd.launcher.topology import (Topology, router_argv, server_argv, server_env, wan_emulator_argvs,
                                          write_operator_token, write_wan_key)

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "artifacts" / "tiny-llama"
DEFAULT_MLA_MODEL = REPO_ROOT / "artifacts" / "tiny-deepseek"  # MLA attention (DeepSeek-V2 style)
DEFAULT_SWA_MODEL = REPO_ROOT / "artifacts" / "tiny-mellum"  # hybrid sliding-window (Mellum style)


def default_model_path(env: str = "PDD_MODEL_DIR", default: Path = DEFAULT_MODEL) -> str:
    path = Path(os.environ.get(env, default))
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model at {path}; run scripts/setup.sh (it builds the tiny models)")
    return str(path)


def default_mla_model_path() -> str:
    return default_model_path("PDD_MLA_MODEL_DIR", DEFAULT_MLA_MODEL)


def default_swa_model_path() -> str:
    return default_model_path("PDD_SWA_MODEL_DIR", DEFAULT_SWA_MODEL)


class LocalCluster(ClusterProcesses):
    """P + RLD (datacenter A), MD (datacenter B) and the router, as separate processes."""

    def __init__(self, run_dir: Path, model_path: Optional[str] = None,
                 topology: Optional[Topology] = None, router_args: Optional[list[str]] = None):
        self.run_dir = Path(run_dir)
        self.router_args = router_args or []
        self.model_path = model_path or default_model_path()
        self.topology = topology or Topology.on_free_ports()
        self.procs = ProcessGroup(self.run_dir / "logs")
        self.wan_key_file = write_wan_key(self.run_dir / "wan.key")
        self.topology.key_file = str(self.wan_key_file)  # the router signs its control calls with it
        self.operator_token_file = write_operator_token(self.run_dir / "operator.token")
        self.topology.operator_token_file = str(self.operator_token_file)

    @property
    def control_key(self) -> bytes:
        """The shared key, for signing one's own calls to MD's and P's control APIs
        (launcher.http's ``key=``)."""
        from sglang_pdd.kv_channel.handshake import load_key

        return load_key(str(self.wan_key_file))

    @property
    def operator_headers(self) -> dict[str, str]:
        """Headers that make a request to the router an operator's (pdd_options, meta_info.pdd)."""
        from sglang_pdd.router.front.app import OPERATOR_HEADER

        return {OPERATOR_HEADER: self.operator_token_file.read_text().strip()}

    def start(self, timeout_s: float = 600.0) -> "LocalCluster":
        topo = self.topology
        for spec in topo.servers:
            argv = server_argv(spec, self.model_path, str(self.wan_key_file), topo.intra_dc_transport)
            self.procs.start(spec.name, netns_exec_argv(spec.netns, argv) if spec.netns else argv,
                             health_url=f"{spec.url}/health", env=server_env(spec))
        for name, argv, health_url in wan_emulator_argvs(topo):  # one link per MD rank
            self.procs.start(name, argv, health_url=health_url)
        self.procs.start("router", router_argv(topo, self.model_path, self.router_args),
                         health_url=f"{topo.router_url}/health")
        with tqdm(total=len(self.procs.procs), desc="waiting for servers", unit="proc",
                  file=sys.stderr) as bar:
            self.procs.wait_healthy(timeout_s=timeout_s, progress=lambda name: bar.update(1))
        return self

    def restart_router(self, router_args: list[str]) -> None:
        """Same servers, a router with other knobs (e.g. another handoff mode)."""
        self.procs.stop("router")
        self.router_args = router_args
        self.procs.start("router", router_argv(self.topology, self.model_path, router_args),
                         health_url=f"{self.topology.router_url}/health")
        self.procs.wait_healthy(["router"], timeout_s=120)

    def wan_control(self, action: str, **params) -> dict:
        """Drive the emulated WAN: stall, partition, heal, reset, corrupt, link (see kv_channel
        docs), on every link (one per MD and MD rank); returns the first MD's link 0's answer (``wan_control_each``: all)."""
        return self.wan_control_each(action, **params)[0]

    def wan_control_each(self, action: str, **params) -> list[dict]:
        from urllib.parse import urlencode

        from sglang_pdd.launcher.http import get_json

        if not self.topology.wan_emulated:
            raise RuntimeError("the WAN is a kernel link here (datacenter B in a network namespace): "
                               "no emulator to stall, partition or reset")

        query = f"?{urlencode(params)}" if params else ""
        return [get_json(f"{url}/{action}{query}") for wan in self.topology.wans for url in wan.control_urls]
