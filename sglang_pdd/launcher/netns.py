"""Datacenter B in a network namespace of its own, joined to datacenter A (the root namespace)
by one veth pair shaped with tbf in both directions.

Every byte between the datacenters then crosses one kernel link, whoever sends it: this
project's WAN KV, the router's control calls and MD's streams, and for SGLang's own PD its
bootstrap and Mooncake traffic. The kernel here has tbf but no netem, so the link has a rate
but no delay (the same for every design); the bytes it carried are the veth's counters.

Names carry the owner (the launcher's pid and its start time in clock ticks, which tells a
live owner from a reused pid), so a run killed with SIGKILL is cleaned up by the next one:
``sweep()`` removes every namespace and veth whose owner is gone, and ends the processes left
in such a namespace. A normal exit, Ctrl-C or SIGTERM removes them at once.

    python -m sglang_pdd.launcher.netns list     # this project's namespaces / veths, owner alive?
    python -m sglang_pdd.launcher.netns sweep    # remove those whose owner is gone

The pure parts (names, owners, tc argv, subnets, counters) are functions of their inputs.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

logger = logging.getLogger(__name__)

NAMESPACE_PREFIX = "pdd-dc"
_NAMESPACE_RE = re.compile(rf"^{NAMESPACE_PREFIX}-(\d+)-(\d+)-(\d+)$")
# veth names are at most 15 characters (IFNAMSIZ); the owner also goes into the A end's alias
_VETH_RE = re.compile(r"^pdd(\d+)[ab](\d+)$")
ALIAS_PREFIX = "pdd-dc owner="
SUBNET_POOL = ipaddress.ip_network("10.211.0.0/16")  # carved into /30s, one per link
# tbf's queue bound: a busy link delays what crosses it by up to this much (a bottleneck's queue).
TBF_LATENCY_MS = 100


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``, or the kernel refused)."""


@dataclass(frozen=True)
class Owner:
    """The process a namespace belongs to; ``start_ticks`` (/proc/PID/stat field 22) tells it
    from a later process that got the same pid."""

    pid: int
    start_ticks: int


def process_start_ticks(pid: int, proc: Path = Path("/proc")) -> Optional[int]:
    """A live process's start time in clock ticks since boot, None if there is no such process."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count from the last ')'
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])


def current_owner() -> Owner:
    pid = os.getpid()
    return Owner(pid, process_start_ticks(pid) or 0)


def owner_alive(owner: Owner, start_ticks_of: Callable[[int], Optional[int]] = process_start_ticks) -> bool:
    return start_ticks_of(owner.pid) == owner.start_ticks


def namespace_name(owner: Owner, index: int) -> str:
    return f"{NAMESPACE_PREFIX}-{owner.pid}-{owner.start_ticks}-{index}"


def owner_of_namespace(name: str) -> Optional[Owner]:
    """The owner a namespace name carries; None for a name that is not this project's."""
    m = _NAMESPACE_RE.match(name)
    return Owner(int(m.group(1)), int(m.group(2))) if m else None


def owner_alias(owner: Owner) -> str:
    return f"{ALIAS_PREFIX}{owner.pid}:{owner.start_ticks}"


def owner_of_alias(alias: str) -> Optional[Owner]:
    if not alias.startswith(ALIAS_PREFIX):
        return None
    pid, _, ticks = alias[len(ALIAS_PREFIX):].strip().partition(":")
    return Owner(int(pid), int(ticks)) if pid.isdigit() and ticks.isdigit() else None


def veth_names(owner: Owner, index: int) -> tuple[str, str]:
    """(A end, B end): ``pdd<pid>a<index>``; within IFNAMSIZ for any Linux pid and index < 1000."""
    if not 0 <= index < 1000:
        raise ValueError(f"link index {index} out of 0..999")
    return f"pdd{owner.pid}a{index}", f"pdd{owner.pid}b{index}"


def parse_netns_list(text: str) -> list[str]:
    """Names in ``ip netns list`` output (``NAME`` or ``NAME (id: N)`` per line)."""
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def used_networks(ip_addr_text: str) -> list[ipaddress.IPv4Network]:
    """IPv4 networks of ``ip -4 -o addr`` output lines (``... inet 10.0.0.1/30 ...``)."""
    nets = []
    for m in re.finditer(r"\binet (\d+\.\d+\.\d+\.\d+/\d+)", ip_addr_text):
        nets.append(ipaddress.ip_interface(m.group(1)).network)
    return nets


def pick_subnet(seed: int, used: Iterable[ipaddress.IPv4Network],
                pool: ipaddress.IPv4Network = SUBNET_POOL) -> ipaddress.IPv4Network:
    """A /30 of ``pool`` that overlaps none of ``used``, the search starting at ``seed``'s
    (different runs start at different places, so concurrent runs rarely probe the same one)."""
    subnets = list(pool.subnets(new_prefix=30))
    used = list(used)
    for i in range(len(subnets)):
        net = subnets[(seed + i) % len(subnets)]
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsUnavailable(f"no free /30 left in {pool}")


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Bucket depth: ~2 ms of line rate, at least 16 KiB (a few MTU-sized segments; a smaller
    bucket cannot pass a GSO burst without splitting it into slivers)."""
    return max(16 * 1024, int(rate_mbit * 1e6 / 8 * 0.002))


def tbf_argv(dev: str, rate_mbit: float, change: bool = False, netns: Optional[str] = None) -> list[str]:
    """``tc qdisc add|change dev DEV root tbf ...`` (``netns``: run inside that namespace)."""
    if rate_mbit <= 0:
        raise ValueError(f"link rate must be > 0 Mbit/s, got {rate_mbit}")
    rate_kbit = max(8, round(rate_mbit * 1000))
    cmd = ["tc", "qdisc", "change" if change else "add", "dev", dev, "root", "tbf", "rate", f"{rate_kbit}kbit",
           "burst", str(tbf_burst_bytes(rate_mbit)), "latency", f"{TBF_LATENCY_MS}ms"]
    return (["ip", "netns", "exec", netns] if netns else []) + cmd


def netns_exec_argv(netns: str, argv: list[str]) -> list[str]:
    """``argv`` run inside ``netns``: ``ip netns exec`` enters the namespace and execs it (same
    pid, so the launcher's process supervision holds), with /sys showing B's interfaces."""
    return ["ip", "netns", "exec", netns, *argv]


@dataclass(frozen=True)
class LinkPlan:
    owner: Owner
    index: int
    namespace: str
    veth_a: str  # in A (the root namespace)
    veth_b: str  # in B
    a_ip: str
    b_ip: str
    prefix_len: int = 30


def plan_link(owner: Owner, index: int, used: Iterable[ipaddress.IPv4Network]) -> LinkPlan:
    net = pick_subnet(owner.pid * 7 + index, used)
    a, b = list(net.hosts())[:2]
    veth_a, veth_b = veth_names(owner, index)
    return LinkPlan(owner, index, namespace_name(owner, index), veth_a, veth_b, str(a), str(b), net.prefixlen)


def link_counters(stats_dir: Path) -> tuple[int, int]:
    """(bytes sent A->B, bytes sent B->A) from the A end's statistics directory."""
    return int((stats_dir / "tx_bytes").read_text()), int((stats_dir / "rx_bytes").read_text())


# ---------------------------------------------------------------------------------- I/O
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def unavailable_reason() -> Optional[str]:
    """Why this process cannot make namespaces (None: it may try)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); not running as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def list_namespaces() -> list[str]:
    return parse_netns_list(_ip("netns", "list", check=False).stdout)


def _link_aliases() -> dict[str, str]:
    """Root-namespace interfaces with an alias: name -> alias."""
    out = {}
    for dev in Path("/sys/class/net").iterdir():  # noqa: the root namespace's view (no `ip netns exec`)
        try:
            alias = (dev / "ifalias").read_text().strip()
        except OSError:
            continue
        if alias:
            out[dev.name] = alias
    return out


def project_leftovers() -> list[tuple[str, str, Owner, bool]]:
    """(kind "netns"|"veth", name, owner, owner alive) of everything this module made that
    still exists, in any run."""
    found = []
    for name in list_namespaces():
        owner = owner_of_namespace(name)
        if owner is not None:
            found.append(("netns", name, owner, owner_alive(owner)))
    aliases = _link_aliases()
    for dev in sorted(p.name for p in Path("/sys/class/net").iterdir()):
        owner = owner_of_alias(aliases.get(dev, ""))
        if owner is not None:
            found.append(("veth", dev, owner, owner_alive(owner)))
        elif (m := _VETH_RE.match(dev)) and dev not in aliases:  # a run that died before naming its owner
            pid = int(m.group(1))
            found.append(("veth", dev, Owner(pid, 0), process_start_ticks(pid) is not None))
    return found


def pids_in(namespace: str) -> list[int]:
    """The processes running in ``namespace`` (``ip netns pids``)."""
    return [int(pid) for pid in _ip("netns", "pids", namespace, check=False).stdout.split() if pid.isdigit()]


def renice_namespace(namespace: str, nice: int) -> int:
    """Every thread of every process in ``namespace`` at ``nice``; the threads reniced. Threads,
    not processes: Linux keeps a nice value per thread, and SGLang's servers have started theirs
    by the time a caller asks."""
    done = 0
    for pid in pids_in(namespace):
        try:
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:  # gone meanwhile
            continue
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                done += 1
            except OSError:
                pass
    return done


def _end_processes_in(namespace: str) -> None:
    """SIGKILL what a dead owner left running in its namespace (it would keep the namespace,
    and so the veth, alive after ``ip netns del``)."""
    for pid in pids_in(namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sweep() -> list[str]:
    """Remove every namespace and veth of this project whose owner is gone; returns their names."""
    removed = []
    for kind, name, _owner, alive in project_leftovers():
        if alive:
            continue
        if kind == "netns":
            _end_processes_in(name)
            _ip("netns", "del", name, check=False)
        else:
            _ip("link", "del", name, check=False)  # removes the pair, wherever the other end is
        removed.append(name)
        logger.warning("removed %s %s left by a run that is gone", kind, name)
    return removed


_next_index = 0


class DatacenterLink:
    """Namespace B and the shaped veth pair to it, for one run; a context manager. ``create``
    first sweeps what dead runs left behind."""

    def __init__(self, rate_mbit: float):
        global _next_index
        self.rate_mbit = rate_mbit
        self.plan: Optional[LinkPlan] = None
        self._index = _next_index
        _next_index += 1

    @property
    def namespace(self) -> str:
        return self.plan.namespace

    @property
    def a_ip(self) -> str:
        return self.plan.a_ip

    @property
    def b_ip(self) -> str:
        return self.plan.b_ip

    def create(self) -> "DatacenterLink":
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        sweep()
        used = used_networks(_ip("-4", "-o", "addr", check=False).stdout)
        plan = plan_link(current_owner(), self._index, used)
        atexit.register(self.destroy)  # a normal exit or SystemExit (SIGTERM) removes it too
        self.plan = plan
        try:
            _ip("netns", "add", plan.namespace)
            _ip("link", "add", plan.veth_a, "type", "veth", "peer", "name", plan.veth_b)
            # the alias says whose it is, should the run die before the B end is in its namespace
            _ip("link", "set", "dev", plan.veth_a, "alias", owner_alias(plan.owner))
            _ip("link", "set", plan.veth_b, "netns", plan.namespace)
            _ip("addr", "add", f"{plan.a_ip}/{plan.prefix_len}", "dev", plan.veth_a)
            _ip("link", "set", plan.veth_a, "up")
            _ip("-n", plan.namespace, "addr", "add", f"{plan.b_ip}/{plan.prefix_len}", "dev", plan.veth_b)
            _ip("-n", plan.namespace, "link", "set", plan.veth_b, "up")
            _ip("-n", plan.namespace, "link", "set", "lo", "up")
            self._tc(tbf_argv(plan.veth_a, self.rate_mbit))
            self._tc(tbf_argv(plan.veth_b, self.rate_mbit, netns=plan.namespace))
        except BaseException:
            self.destroy()
            raise
        logger.info("datacenter B in namespace %s (%s), A end %s (%s), %.3g Mbit/s each way",
                    plan.namespace, plan.b_ip, plan.veth_a, plan.a_ip, self.rate_mbit)
        return self

    def set_rate(self, rate_mbit: float) -> None:
        """Change the link's rate in both directions (``tc qdisc change``), servers untouched."""
        self._tc(tbf_argv(self.plan.veth_a, rate_mbit, change=True))
        self._tc(tbf_argv(self.plan.veth_b, rate_mbit, change=True, netns=self.plan.namespace))
        self.rate_mbit = rate_mbit

    def counters(self) -> tuple[int, int]:
        """(bytes A->B, bytes B->A) the link has carried since it was made."""
        return link_counters(Path("/sys/class/net") / self.plan.veth_a / "statistics")

    def destroy(self) -> None:
        """Remove the veth pair and the namespace (idempotent). Stop the processes inside first:
        a namespace with processes in it outlives its name."""
        plan, self.plan = self.plan, None
        if plan is None:
            return
        _end_processes_in(plan.namespace)
        _ip("link", "del", plan.veth_a, check=False)
        _ip("netns", "del", plan.namespace, check=False)
        try:
            atexit.unregister(self.destroy)
        except Exception:  # pragma: no cover - atexit never raises here
            pass

    @staticmethod
    def _tc(argv: list[str]) -> None:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        self.destroy()


def link_or_fallback(rate_mbit: float, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)
                     ) -> Optional[DatacenterLink]:
    """A created DatacenterLink, or None after saying why not (the caller then uses the
    userspace WAN emulator, as without the option)."""
    try:
        return DatacenterLink(rate_mbit).create()
    except NetnsUnavailable as e:
        log(f"cannot put datacenter B in a network namespace ({e}); falling back to the userspace "
            f"WAN emulator between P and MD (only P's WAN KV crosses it)")
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["list", "sweep"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.action == "sweep":
        removed = sweep()
        print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove")
        return 0
    for kind, name, owner, alive in project_leftovers():
        print(f"{kind:6s} {name:32s} owner pid {owner.pid} {'alive' if alive else 'gone'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
