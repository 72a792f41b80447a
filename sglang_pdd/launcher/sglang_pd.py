"""SGLang's own PD disaggregation, run unmodified: the baseline PDD is measured against.

A prefill and a decode server (``--disaggregation-mode prefill|decode``, KV over Mooncake, its
TCP transport on CPU) and SGLang's own PD router in front (``python -m
sglang_router.launch_router --pd-disaggregation``). The decode server runs in datacenter A
(same-datacenter PD) or in datacenter B's network namespace (cross-datacenter PD: its KV,
SGLang's bootstrap calls and the router's requests to it cross the shaped veth). The pdd plugin
is not loaded (SGLANG_PLUGINS names none of it); what differs from stock SGLang 0.5.23 is only
the CPU diffs in patches/ that every server here runs with.

Pure argv/env builders plus a small supervisor like LocalCluster's.
"""

from __future__ import annotations

import sys
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from sglang_pdd.launcher.http import post_json
from sglang_pdd.launcher.netns import netns_exec_argv
from sglang_pdd.launcher.processes import ClusterProcesses, ProcessFailed, ProcessGroup
from sglang_pdd.launcher.topology import CPU_ENV, CPU_SERVER_FLAGS, LOOPBACK, ServerSpec, free_port

# A plugin name no installed plugin has: SGLang then loads none (its SGLANG_PLUGINS whitelist).
NO_PLUGINS = "none"


@dataclass
class SglangPdTopology:
    """One prefill, one decode server, SGLang's PD router. ``decode_radix_cache``: SGLang's
    experimental decode-side radix cache (``--disaggregation-decode-enable-radix-cache``):
    the decode server keeps prior prompts and prefill sends only the rest."""

    prefill: ServerSpec
    decode: ServerSpec
    bootstrap_port: int
    router_port: int
    metrics_port: int  # the router's Prometheus port (a fixed default would clash with another router)
    decode_radix_cache: bool = False
    extra_args: list[str] = field(default_factory=list)  # both servers (e.g. --dtype float32)

    @classmethod
    def on_free_ports(cls, decode_radix_cache: bool = False) -> "SglangPdTopology":
        return cls(ServerSpec("sglang-prefill", None, free_port(), "dc-a"),
                   ServerSpec("sglang-decode", None, free_port(), "dc-a"),
                   bootstrap_port=free_port(), router_port=free_port(), metrics_port=free_port(),
                   decode_radix_cache=decode_radix_cache)

    def place_decode_in_datacenter_b(self, a_host: str, b_host: str, netns: str) -> "SglangPdTopology":
        """The decode server in namespace ``netns`` at ``b_host``; the prefill server then
        listens on A's end of the veth (``a_host``), since the decode server dials its bootstrap
        server and Mooncake endpoint from B."""
        self.prefill.host = a_host
        self.decode.host, self.decode.netns = b_host, netns
        return self

    @property
    def router_url(self) -> str:
        return f"http://{LOOPBACK}:{self.router_port}"

    @property
    def servers(self) -> list[ServerSpec]:
        return [self.prefill, self.decode]


def pd_server_argv(topo: SglangPdTopology, spec: ServerSpec, model_path: str) -> list[str]:
    """The same CPU flags as PDD's servers (model, page size, pool, batch size), SGLang's PD
    mode on Mooncake. Both sleep when idle, as P and RLD do: an idle SGLang scheduler
    busy-polls a core, and a PD server sleeps only when nothing is queued or in transfer."""
    mode = "prefill" if spec is topo.prefill else "decode"
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
            "--host", spec.host, "--port", str(spec.port), *CPU_SERVER_FLAGS, "--tp", str(spec.tp),
            "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "mooncake", "--sleep-on-idle"]
    if mode == "prefill":
        argv += ["--disaggregation-bootstrap-port", str(topo.bootstrap_port)]
    else:
        # the default host retraction backup calls torch.cuda.cudart()
        argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        if topo.decode_radix_cache:
            argv += ["--disaggregation-decode-enable-radix-cache"]
    return argv + list(topo.extra_args) + list(spec.extra_args)


def pd_server_env(spec: ServerSpec) -> dict[str, str]:
    """CPU_ENV without the plugin; SGLANG_HOST_IP is the address the server's KV endpoints
    (bootstrap, Mooncake) are reached on."""
    return {**CPU_ENV, "SGLANG_PLUGINS": NO_PLUGINS, "SGLANG_HOST_IP": spec.host}


def pd_router_argv(topo: SglangPdTopology) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", topo.prefill.url, str(topo.bootstrap_port), "--decode", topo.decode.url,
            "--host", LOOPBACK, "--port", str(topo.router_port),
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(topo.metrics_port)]


class SglangPdCluster(ClusterProcesses):
    """The two servers and the router as separate processes, a log each; a context manager."""

    def __init__(self, run_dir: Path, model_path: str, topology: SglangPdTopology):
        self.topology = topology
        self.model_path = model_path
        self.procs = ProcessGroup(Path(run_dir) / "logs")

    def start(self, timeout_s: float = 600.0) -> "SglangPdCluster":
        topo = self.topology
        for spec in topo.servers:
            argv = pd_server_argv(topo, spec, self.model_path)
            self.procs.start(spec.name, netns_exec_argv(spec.netns, argv) if spec.netns else argv,
                             health_url=f"{spec.url}/health", env=pd_server_env(spec))
        # the router checks its workers when it starts: after they are up
        with tqdm(total=3, desc="waiting for SGLang PD", unit="proc", file=sys.stderr) as bar:
            self.procs.wait_healthy(timeout_s=timeout_s, progress=lambda name: bar.update(1))
            self.procs.start("sglang-router", pd_router_argv(topo), health_url=f"{topo.router_url}/health")
            self.procs.wait_healthy(["sglang-router"], timeout_s=120, progress=lambda name: bar.update(1))
            self._wait_serving(timeout_s=120)
        return self

    def _wait_serving(self, timeout_s: float) -> None:
        """Until a one-token request goes through: the router answers /health before it has
        activated its workers (503 "No prefill workers available" meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                post_json(f"{self.topology.router_url}/generate", {
                    "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, timeout=60)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                self.procs.check_alive()
                if time.monotonic() > deadline:
                    raise ProcessFailed(f"SGLang's PD router serves no request after {timeout_s:.0f}s: {e}") from e
                time.sleep(0.5)


def describe(topo: SglangPdTopology) -> str:
    where = (f"decode in datacenter B ({topo.decode.host}, namespace {topo.decode.netns})" if topo.decode.netns
             else "decode in datacenter A")
    return (f"SGLang PD: prefill {topo.prefill.url}, {where}, router {topo.router_url}"
            + (", decode radix cache" if topo.decode_radix_cache else ""))
