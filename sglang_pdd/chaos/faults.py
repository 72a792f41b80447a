"""What makes each fault happen on the local cluster, and what ends it (blocking I/O).

With datacenter B in a network namespace (``link``: launcher.netns.DatacenterLink) the WAN is
the kernel link between the namespaces: it goes down with ``ip link set ... down`` on B's
end (every byte between the datacenters is lost: P's WAN KV, the router's control calls, MD's
streams) and its rate is cut with tc. Without one (not root) the userspace WAN emulator's
faults stand in (partition / heal, its link rate), which carry only P's WAN KV; the runner
says so when it starts.

``fire`` starts a fault, ``recover`` ends it and returns once the cluster is whole again: a
killed server started again and healthy, and the router's breaker for it closed (a probe
passed), so that what follows meets a recovered cluster.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import threading
import time
import urllib.request
from typing import Optional

from sglang_pdd.chaos import probe
from sglang_pdd.chaos.spec import MD_SLOW_PERIOD_S, MD_SLOW_STOPPED_SHARE, WAN_SLOWDOWN, Fault, FaultKind

logger = logging.getLogger(__name__)

# SIGTERM lets the router finish the streams it runs (aiohttp waits up to 60 s for them)
ROUTER_GRACE_S = 75.0
RECOVERY_TIMEOUT_S = 600.0


class FaultInjector:
    def __init__(self, cluster, link=None):
        self.cluster, self.link = cluster, link
        topo = cluster.topology
        self._targets = {FaultKind.KILL_RLD: topo.relay, FaultKind.KILL_MD: topo.main, FaultKind.KILL_P: topo.prefill}
        self._slow: Optional[threading.Event] = None
        self._slow_thread: Optional[threading.Thread] = None
        self._stopped = False  # MD_STOP holds MD stopped

    @property
    def netns(self) -> bool:
        return self.link is not None

    def describe_wan(self) -> str:
        if self.netns:
            plan = self.link.plan
            return (f"kernel link {plan.veth_a} ({plan.a_ip}) <-> namespace {plan.namespace} ({plan.b_ip}), "
                    f"{self.link.rate_mbit:g} Mbit/s: WAN faults are `ip link set down` and tc on it")
        return ("userspace WAN emulator (not root, or namespaces unavailable): WAN faults are its partition and "
                "link rate, and cover P's WAN KV only (the router's calls to MD and MD's streams do not cross it)")

    # ------------------------------------------------------------------ start / end
    def fire(self, fault: Fault) -> None:
        kind = fault.kind
        logger.warning("fault: %s (hold %.1fs)", kind.value, fault.hold_s)
        if kind.kills:
            self.cluster.procs.kill(self._targets[kind].name)
        elif kind is FaultKind.WAN_DOWN:
            self._wan_down()
        elif kind is FaultKind.WAN_SLOW:
            self._wan_rate(1 / WAN_SLOWDOWN)
        elif kind is FaultKind.ROUTER_RESTART:
            self.cluster.procs.restart("router", grace_s=ROUTER_GRACE_S, timeout_s=RECOVERY_TIMEOUT_S)
        elif kind is FaultKind.MD_DRAIN:
            self._drain(True)
        elif kind is FaultKind.MD_SLOW:
            self._start_slow_md()
        elif kind is FaultKind.MD_STOP:
            self._stopped = True
            self.cluster.procs.signal(self.cluster.topology.main.name, signal.SIGSTOP)
        else:  # pragma: no cover - a new kind without its I/O
            raise AssertionError(kind)

    def recover(self, fault: Fault) -> None:
        kind = fault.kind
        if kind.kills:
            spec = self._targets[kind]
            self.cluster.procs.start_again(spec.name, timeout_s=RECOVERY_TIMEOUT_S)
            self._wait_closed(kind_role(kind), spec.url)
        elif kind is FaultKind.WAN_DOWN:
            self._wan_up()
            self._wait_closed("main", self.cluster.topology.main.url)
        elif kind is FaultKind.WAN_SLOW:
            self._wan_rate(1.0)
        elif kind is FaultKind.ROUTER_RESTART:
            pass  # fire returned with the new router serving
        elif kind is FaultKind.MD_DRAIN:
            self._drain(False)
        elif kind is FaultKind.MD_SLOW:
            self._stop_slow_md()
            self._wait_closed("main", self.cluster.topology.main.url)
        elif kind is FaultKind.MD_STOP:
            self._continue_md()
            self._wait_closed("main", self.cluster.topology.main.url)
        logger.warning("recovered: %s", kind.value)

    def cleanup(self) -> None:
        """Whatever a fault left on (an interrupted run): MD running, the link up at its rate."""
        self._stop_slow_md()
        self._continue_md()
        if self.netns and self.link.plan is not None:
            self._wan_up()

    # ------------------------------------------------------------------ the WAN
    def _wan_down(self) -> None:
        # Datacenter B's end only: A's end then has no carrier but keeps its route, so what A
        # sends to B is lost on the link, as on a cut WAN. With A's end down too, A's route to
        # B would go and the traffic would take the default route instead (on a sandbox, to a
        # proxy that answers 404 for B's address: not a WAN outage).
        if self.netns:
            plan = self.link.plan
            _run(["ip", "-n", plan.namespace, "link", "set", plan.veth_b, "down"])
        else:
            self.cluster.wan_control("partition")

    def _wan_up(self) -> None:
        if self.netns:
            plan = self.link.plan
            _run(["ip", "-n", plan.namespace, "link", "set", plan.veth_b, "up"])
            _run(["ip", "link", "set", plan.veth_a, "up"])  # a no-op unless something else took it down
        else:
            self.cluster.wan_control("heal")

    def _wan_rate(self, factor: float) -> None:
        base = self.cluster.topology.wan.rate_gbps
        if self.netns:
            self.link.set_rate(base * 1000 * factor)
        else:
            self.cluster.wan_control("link", rate_gbps=base * factor)

    # ------------------------------------------------------------------ MD
    def _drain(self, draining: bool) -> None:
        body = json.dumps({"url": self.cluster.topology.main.url, "draining": draining}).encode()
        req = urllib.request.Request(f"{self.cluster.topology.router_url}/pdd/backends/drain", data=body,
                                     method="POST", headers={"Content-Type": "application/json",
                                                             **self.cluster.operator_headers})
        with urllib.request.urlopen(req, timeout=30) as resp:
            reply = json.loads(resp.read())
        if reply.get("draining") is not draining:
            raise RuntimeError(f"drain answered {reply}")

    def _start_slow_md(self) -> None:
        """MD's whole process group stopped for most of each period, as a noisy neighbour."""
        name = self.cluster.topology.main.name
        stop = self._slow = threading.Event()

        def cycle() -> None:
            stopped_s = MD_SLOW_PERIOD_S * MD_SLOW_STOPPED_SHARE
            while not stop.is_set():
                self.cluster.procs.signal(name, signal.SIGSTOP)
                stop.wait(stopped_s)
                self.cluster.procs.signal(name, signal.SIGCONT)
                stop.wait(MD_SLOW_PERIOD_S - stopped_s)

        self._slow_thread = threading.Thread(target=cycle, name="chaos-slow-md", daemon=True)
        self._slow_thread.start()

    def _stop_slow_md(self) -> None:
        if self._slow is None:
            return
        self._slow.set()
        self._slow_thread.join()
        self._slow = self._slow_thread = None
        name = self.cluster.topology.main.name
        if name in self.cluster.procs.procs:
            self.cluster.procs.signal(name, signal.SIGCONT)

    def _continue_md(self) -> None:
        if not self._stopped:
            return
        self._stopped = False
        name = self.cluster.topology.main.name
        if name in self.cluster.procs.procs:
            self.cluster.procs.signal(name, signal.SIGCONT)

    # ------------------------------------------------------------------ recovered?
    def _wait_closed(self, role: str, url: str) -> None:
        """Until the router's breaker for the server is closed again (a probe or a request
        passed on it): the router then picks it as before the fault."""
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                row = probe.backend_view(self.cluster.topology.router_url, self.cluster.operator_headers, url)
                if row is not None and row["breaker"] == "closed" and not row["draining"]:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the router did not take {role} {url} back within {RECOVERY_TIMEOUT_S:.0f}s")


def kind_role(kind: FaultKind) -> str:
    return {FaultKind.KILL_RLD: "relay", FaultKind.KILL_MD: "main", FaultKind.KILL_P: "prefill"}[kind]


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
