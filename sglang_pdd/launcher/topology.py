"""Command lines for each role of a local PDD topology (pure: builds argv/env, starts nothing).

The CPU flags are the ones that run real SGLang 0.5.23 on a machine without a GPU; on GPUs a
deployment passes its own flags and keeps only the --disaggregation-* / --pdd-* parts.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

LOOPBACK = "127.0.0.1"

# Mooncake over TCP on loopback (tests/demo); production leaves these unset and uses RDMA.
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "MOONCAKE_PROTOCOL": "tcp",
    "MC_FORCE_TCP": "1",
    "SGLANG_HOST_IP": LOOPBACK,
    "SGLANG_PLUGINS": "pdd",
    "TOKENIZERS_PARALLELISM": "false",
}

CPU_SERVER_FLAGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
    "--skip-server-warmup",
    # On CPU the pool is sized from free system memory; a fixed token budget keeps it stable
    # when several servers share the machine.
    "--mem-fraction-static", "0.3", "--max-total-tokens", "65536",
    "--max-running-requests", "16", "--page-size", "1",
]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


_handed_out: set[int] = set()
# Mooncake's transfer engine binds its RPC and TCP-transport ports at random in this range (all
# 136 seen in these servers' logs), not from the kernel's ephemeral range: a port handed out here
# could be taken by a Mooncake engine starting in between, and the server then fails to bind.
MOONCAKE_PORTS = range(15000, 17000)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK, count: int = 1) -> int:
    """A port nobody listens on, chosen *below* the kernel's ephemeral range and outside
    Mooncake's: the servers bind it seconds later, and meanwhile other processes bind port 0
    (ZMQ, TCP engines: the kernel serves it from the ephemeral range) or a random port of
    MOONCAKE_PORTS, so they cannot take it in between.
    ``count``: the first of that many consecutive free ports (one per TP rank of P's control API)."""
    low, _ = _ephemeral_range()
    lo, hi = (10000, low - 1) if low > 12000 else (low, 65535)  # odd ranges: fall back to any
    for _ in range(1000):
        port = random.randint(lo, hi - count + 1)
        ports = range(port, port + count)
        if any(p in _handed_out or p in MOONCAKE_PORTS for p in ports) or not all(_bindable(host, p) for p in ports):
            continue
        _handed_out.update(ports)
        return port
    raise RuntimeError(f"no {count} free port(s) in {lo}..{hi}")


def omp_threads_bind(tp: int, cores: list[int]) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for ``tp`` ranks: the cores split into ``tp`` consecutive
    groups, '|'-separated (with fewer cores than ranks, ranks share cores round-robin).
    SGLang on CPU asserts without it when it runs more ranks than NUMA nodes."""
    cores = sorted(cores)
    if tp > len(cores):
        return "|".join(str(cores[rank % len(cores)]) for rank in range(tp))
    per, extra = divmod(len(cores), tp)
    groups, start = [], 0
    for rank in range(tp):
        group = cores[start:start + per + (rank < extra)]
        start += len(group)
        contiguous = group[-1] - group[0] == len(group) - 1
        groups.append(f"{group[0]}-{group[-1]}" if contiguous and len(group) > 1 else ",".join(map(str, group)))
    return "|".join(groups)


def _machine_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class ControlTlsFiles:
    """PEM files for mutual TLS on the control plane: the certificate P and MD serve their
    control APIs with (it must name 127.0.0.1, the address the router dials here), the
    router's client certificate, their keys (mode 0600) and the CA that signed both."""

    server_cert: str
    server_key: str
    router_cert: str
    router_key: str
    ca: str

    def server_flags(self) -> list[str]:
        return ["--pdd-control-tls-cert", self.server_cert, "--pdd-control-tls-key", self.server_key,
                "--pdd-control-tls-ca", self.ca]

    def router_flags(self) -> list[str]:
        return ["--control-tls-cert", self.router_cert, "--control-tls-key", self.router_key,
                "--control-tls-ca", self.ca]


@dataclass
class ServerSpec:
    name: str  # "prefill-0", "relay-0", "main-0", "single"
    role: Optional[str]  # PDD role, or None for a plain server
    port: int
    datacenter: str = ""
    bootstrap_port: Optional[int] = None  # prefill only
    wan_listen_port: Optional[int] = None  # main only: rank r's WAN receiver on this port + r
    control_port: Optional[int] = None  # main: MD's control API; prefill: late WAN destinations
    wan_peers: list[str] = field(default_factory=list)  # prefill: the only MD WAN addresses P may send KV to
    # SGLang --tp. Prefill: rank r serves its control API on control_port + r (control_port is
    # the first of tp consecutive free ports). Main: rank r's WAN receiver on wan_listen_port + r.
    tp: int = 1
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)  # on top of server_env's
    control_tls: Optional[ControlTlsFiles] = None  # prefill/main: the control API on mutual TLS (https)
    # The address the server's ports are reached on, and the network namespace it runs in
    # (None: the launcher's own). Datacenter B in a namespace: B's end of the veth.
    host: str = LOOPBACK
    netns: Optional[str] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def control_url(self) -> Optional[str]:
        scheme = "https" if self.control_tls else "http"
        return f"{scheme}://{self.host}:{self.control_port}" if self.control_port else None

    @property
    def bind_host(self) -> str:
        """SGLang's --host. In a namespace of its own every interface: that is the namespace's
        loopback and its end of the veth only, and MD's handoff relay calls its own server on
        127.0.0.1 (sglang_glue/md/loopback.py)."""
        return "0.0.0.0" if self.netns else self.host


def server_argv(spec: ServerSpec, model_path: str, wan_key_file: Optional[str] = None,
                intra_dc_transport: str = "auto") -> list[str]:
    """``intra_dc_transport``: P -> RLD engine, ``auto`` (Mooncake if installed), ``mooncake`` or ``tcp``."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
            "--host", spec.bind_host, "--port", str(spec.port), *CPU_SERVER_FLAGS, "--tp", str(spec.tp)]
    if spec.role == "prefill":
        argv += ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "pdd",
                 "--disaggregation-bootstrap-port", str(spec.bootstrap_port)]
    elif spec.role == "relay":
        argv += ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "pdd",
                 # the default host retraction backup calls torch.cuda.cudart()
                 "--disaggregation-decode-retraction-backup", "cpu_tensor"]
    elif spec.role == "main":
        argv += ["--pdd-wan-listen", f"{spec.host}:{spec.wan_listen_port}"]
    # An idle SGLang scheduler busy-polls a core (measured: 1.01 cores idle, 0.025 with this
    # flag); it wakes on the tokenizer's socket, which brings every P, RLD and plain request,
    # and MD's also when a room command comes or while KV lands (sglang_glue/md/idle_wake.py).
    argv += ["--sleep-on-idle"]
    if spec.role in ("prefill", "main") and spec.control_port:
        # The router (on loopback here) is allow-listed: the only way to the reserved slots.
        argv += ["--pdd-control-listen", f"{spec.host}:{spec.control_port}", "--pdd-control-trusted-sources", LOOPBACK]
        if spec.control_tls:
            argv += spec.control_tls.server_flags()
    if spec.role == "prefill" and spec.wan_peers:
        argv += ["--pdd-wan-peers", ",".join(spec.wan_peers)]
    if spec.role is not None:
        argv += ["--pdd-role", spec.role]
        if spec.datacenter:
            argv += ["--pdd-datacenter", spec.datacenter]
        if spec.role in ("prefill", "main") or (spec.role == "relay" and intra_dc_transport != "mooncake"):
            argv += ["--pdd-wan-key-file", str(wan_key_file)]  # relay: for the TCP engine
        if spec.role in ("prefill", "relay") and intra_dc_transport != "auto":
            argv += ["--pdd-intra-dc-transport", intra_dc_transport]
    return argv + list(spec.extra_args)


def server_env(spec: ServerSpec, cores: Optional[list[int]] = None) -> dict[str, str]:
    """CPU_ENV, the server's own address for its KV transfers (SGLANG_HOST_IP), plus the cores
    of each TP rank when the server runs more than one (``cores``: the machine's, by default),
    then the spec's ``extra_env``."""
    env = {**CPU_ENV, "SGLANG_HOST_IP": spec.host}
    if spec.tp > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = omp_threads_bind(spec.tp, cores or _machine_cores())
    return {**env, **spec.extra_env}


@dataclass
class WanLinkSpec:
    """The emulated WAN between datacenter A (P) and datacenter B (MD's KV receivers). With MD
    on ``--tp N`` it is N links (one emulator process each, with the same settings): link r
    listens on ``listen_port + r``, forwards to MD rank r's receiver and takes its faults on
    ``control_port + r``."""

    rate_gbps: Optional[float] = 1.0
    latency_ms: float = 20.0
    jitter_ms: float = 1.0
    listen_port: int = 0
    control_port: int = 0
    links: int = 1  # MD's TP size

    @property
    def control_url(self) -> str:
        """Link 0's (MD rank 0's) fault/config endpoint."""
        return f"http://{LOOPBACK}:{self.control_port}"

    @property
    def control_urls(self) -> list[str]:
        return [f"http://{LOOPBACK}:{self.control_port + r}" for r in range(self.links)]


@dataclass
class Topology:
    """P(s) and one RLD in datacenter A, MD(s) in datacenter B, the WAN between, a router.
    ``prefill``/``main``/``wan`` are the first P, MD and MD's link; ``prefills``/``mains``/``wans``
    all of them (one emulated WAN link per MD, every P allowed to send to each)."""

    prefill: ServerSpec
    relay: ServerSpec
    main: ServerSpec
    router_port: int
    wan: WanLinkSpec = field(default_factory=WanLinkSpec)
    intra_dc_transport: str = "auto"  # P -> RLD engine: auto, mooncake or tcp
    key_file: Optional[str] = None  # the shared key; the router signs its control calls with it
    operator_token_file: Optional[str] = None  # the router's --operator-token-file
    # P and MD beyond the first (prefill-1.., main-1..), and the WAN link of each such MD
    more_prefills: list[ServerSpec] = field(default_factory=list)
    more_mains: list[ServerSpec] = field(default_factory=list)
    more_wans: list[WanLinkSpec] = field(default_factory=list)
    control_tls: Optional[ControlTlsFiles] = None  # set by use_control_tls
    # P's WAN KV crosses the userspace emulator (wans); False: P dials MD directly, over the
    # kernel link to datacenter B's namespace (place_datacenter_b)
    wan_emulated: bool = True

    def place_datacenter_b(self, host: str, netns: str, rate_gbps: float) -> "Topology":
        """Every MD in network namespace ``netns`` at ``host`` (B's end of the veth), P's WAN KV
        sent to MD directly: the kernel link, not the emulator, is the WAN. It has no delay,
        so the router's transfer estimate gets none either."""
        for spec in self.mains:
            spec.host, spec.netns = host, netns
        self.wan_emulated = False
        for wan in self.wans:
            wan.rate_gbps, wan.latency_ms, wan.jitter_ms = rate_gbps, 0.0, 0.0
        peers = [self.wan_peer(md) for md in range(len(self.mains))]
        for spec in self.prefills:
            spec.wan_peers = list(peers)
        return self

    def wan_peer(self, md: int = 0) -> str:
        """HOST:PORT P dials for MD ``md``'s WAN receiver (rank 0; rank r on port + r): the
        emulated link's, or with datacenter B in a namespace MD's own."""
        if self.wan_emulated:
            return f"{LOOPBACK}:{self.wans[md].listen_port}"
        main = self.mains[md]
        return f"{main.host}:{main.wan_listen_port}"

    def use_control_tls(self, files: ControlTlsFiles) -> "Topology":
        """Every P's and MD's control API on mutual TLS, the router dialling them over https
        with its client certificate."""
        self.control_tls = files
        for spec in (*self.prefills, *self.mains):
            spec.control_tls = files
        return self

    @classmethod
    def on_free_ports(cls, intra_dc_transport: str = "auto", prefill_tp: int = 1, main_tp: int = 1,
                      prefills: int = 1, mains: int = 1) -> "Topology":
        """``prefill_tp``: P's --tp (its control API then takes prefill_tp consecutive ports);
        ``main_tp``: MD's --tp (its WAN receivers, and the WAN links before them, take main_tp
        consecutive ports each). ``prefills``/``mains``: how many P and MD."""
        wans = [WanLinkSpec(listen_port=free_port(count=main_tp), control_port=free_port(count=main_tp),
                            links=main_tp) for _ in range(mains)]
        # P reaches an MD's WAN receiver only through its emulated link: those are P's WAN peers
        peers = [f"{LOOPBACK}:{w.listen_port}" for w in wans]
        ps = [ServerSpec(f"prefill-{i}", "prefill", free_port(), "dc-a", bootstrap_port=free_port(),
                         control_port=free_port(count=prefill_tp), wan_peers=list(peers), tp=prefill_tp)
              for i in range(prefills)]
        ms = [ServerSpec(f"main-{i}", "main", free_port(), "dc-b", wan_listen_port=free_port(count=main_tp),
                         control_port=free_port(), tp=main_tp) for i in range(mains)]
        return cls(
            prefill=ps[0],
            relay=ServerSpec("relay-0", "relay", free_port(), "dc-a"),
            main=ms[0],
            router_port=free_port(),
            wan=wans[0],
            intra_dc_transport=intra_dc_transport,
            more_prefills=ps[1:], more_mains=ms[1:], more_wans=wans[1:],
        )

    @property
    def prefills(self) -> list[ServerSpec]:
        return [self.prefill, *self.more_prefills]

    @property
    def mains(self) -> list[ServerSpec]:
        return [self.main, *self.more_mains]

    @property
    def wans(self) -> list[WanLinkSpec]:
        """MD i's emulated link is wans[i]."""
        return [self.wan, *self.more_wans]

    @property
    def servers(self) -> list[ServerSpec]:
        return [*self.prefills, self.relay, *self.mains]

    @property
    def router_url(self) -> str:
        return f"http://{LOOPBACK}:{self.router_port}"


def wan_emulator_argv(topo: Topology, rank: int = 0, md: int = 0) -> list[str]:
    """The emulated link to MD ``md``'s rank ``rank`` WAN receiver (``wan_emulator_argvs``: all of them)."""
    wan, main = topo.wans[md], topo.mains[md]
    argv = [sys.executable, "-m", "sglang_pdd.launcher.wan_emulator",
            "--listen", f"{LOOPBACK}:{wan.listen_port + rank}",
            "--upstream", f"{LOOPBACK}:{main.wan_listen_port + rank}",
            "--latency-ms", str(wan.latency_ms), "--jitter-ms", str(wan.jitter_ms),
            "--control", f"{LOOPBACK}:{wan.control_port + rank}"]
    if wan.rate_gbps:
        argv += ["--rate-gbps", str(wan.rate_gbps)]
    return argv


def wan_emulator_argvs(topo: Topology) -> list[tuple[str, list[str], str]]:
    """(process name, argv, health URL) of each emulated link, one per MD and MD rank; the first
    MD's link 0 is "wan-emulator" as with one MD on TP 1, MD i's are "wan-emulator-main-i[-r]".
    None when the WAN is a kernel link (Topology.place_datacenter_b)."""
    if not topo.wan_emulated:
        return []
    return [("wan-emulator" + (f"-main-{md}" if md else "") + (f"-{r}" if r else ""),
             wan_emulator_argv(topo, r, md), f"{url}/stats")
            for md, wan in enumerate(topo.wans) for r, url in enumerate(wan.control_urls)]


def router_argv(topo: Topology, model_path: str, extra: Optional[list[str]] = None) -> list[str]:
    # The router's transfer-time estimate describes the link it routes over.
    link = ["--wan-rtt-ms", str(2 * topo.wan.latency_ms)]
    if topo.wan.rate_gbps:
        link += ["--wan-gbps", str(topo.wan.rate_gbps)]
    return [sys.executable, "-m", "sglang_pdd.router", "--host", LOOPBACK, "--port", str(topo.router_port),
            "--tokenizer-path", model_path,
            # P's control URL: the router posts WAN destinations there, MD's answer off the TTFT path
            *[a for p in topo.prefills
              for a in ("--prefill", f"{p.url},{p.bootstrap_port}" + (f",{p.control_url}" if p.control_url else ""))],
            "--relay", topo.relay.url,
            # P reaches MD's WAN receiver through the emulated link (with MD on TP N: rank 0's;
            # P adds the rank to the port, so links listen on consecutive ports too)
            *[a for md, m in enumerate(topo.mains)
              for a in ("--main", f"{m.url},{m.control_url},{topo.wan_peer(md)}")],
            *(["--control-key-file", str(topo.key_file)] if topo.key_file else []),
            *(topo.control_tls.router_flags() if topo.control_tls else []),
            *(["--operator-token-file", str(topo.operator_token_file)] if topo.operator_token_file else []),
            *link, *(extra or [])]


def write_secret(path: Path) -> Path:
    """A fresh random secret (64 hex characters) in a new 0600 file, never readable by others,
    not even briefly; an old file is replaced."""
    import secrets

    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def write_wan_key(path: Path) -> Path:
    """The shared key of this run's WAN and control-plane peers."""
    return write_secret(path)


def write_operator_token(path: Path) -> Path:
    """The router's operator token: requests carrying it may steer PDD and see meta_info.pdd."""
    return write_secret(path)
