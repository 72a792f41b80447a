"""What the servers hold and what the router counted, read over HTTP (blocking I/O).

``held``: for P, RLD and MD the numbers that must all be 0 once the load has ended: SGLang's
own (/v1/loads: requests running and waiting, the PD bootstrap, prealloc and transfer queues)
and PDD's (/pdd/stats: MD's rooms and KV slots held for the WAN, P's waiting senders,
destinations, staged WAN bytes and live WAN rooms). ``flush``: the router's /flush_cache,
forwarded to every backend (each one's status). ``leak_warnings``: SGLang's own pool checks
(run whenever a scheduler is idle) log "memory leak detected" / "double free" /
"use-after-free"; their lines in the servers' logs since a given offset. ``scrape``: the
router's counters. ``leftovers``: processes, namespaces and veths of the run still there.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable, Optional

from sglang_pdd.chaos.checks import MetricKey, counters
from sglang_pdd.control.auth import ROLE_MD, ROLE_P
from sglang_pdd.launcher.http import get_json

# SGLang's /v1/loads sections whose counts are requests a server still holds
_LOAD_FIELDS = {"core": ("num_running_reqs", "num_waiting_reqs"),
                "disaggregation": ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs",
                                   "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs",
                                   "decode_retracted_queue_reqs"),
                "queues": ("grammar", "paused", "retracted")}
LEAK_MARKERS = ("memory leak detected", "double free", "use-after-free")


def sglang_held(url: str) -> dict[str, int]:
    """Requests a server holds, summed over its DP ranks, by SGLang's field name."""
    loads = get_json(f"{url}/v1/loads?include=all", timeout=10)["loads"]
    out: dict[str, int] = {}
    for load in loads:
        for section, names in _LOAD_FIELDS.items():
            values = load.get(section) or {}
            for name in names:
                value = values.get(name, load.get(name)) if section != "core" else load.get("core", load).get(name)
                if isinstance(value, (int, float)):
                    label = name if section == "core" else f"{section}.{name}"
                    out[label] = out.get(label, 0) + int(value)
    return out


def held(cluster) -> dict[str, dict[str, int]]:
    """Server name -> what it holds (every value must be 0 after the load)."""
    topo, key = cluster.topology, cluster.control_key
    out = {spec.name: sglang_held(spec.url) for spec in topo.servers}
    for md in topo.mains:
        stats = get_json(f"{md.control_url}/pdd/stats", key=key, role=ROLE_MD)
        out[md.name].update(open_rooms=int(stats["open_rooms"]), held_kv_slots=int(stats["held_kv_slots"]))
    for p in topo.prefills:
        stats = get_json(f"{p.control_url}/pdd/stats", key=key, role=ROLE_P)
        out[p.name].update({name: int(stats.get(name, 0)) for name in
                            ("waiting_senders", "waiting_destinations", "staged_bytes", "live_rooms")})
    return out


def pool_pages(cluster) -> dict[str, dict[str, int]]:
    """KV pool slots each server still uses; after a flush (no cache left) every one must be 0."""
    out = {}
    for spec in cluster.topology.servers:
        loads = get_json(f"{spec.url}/v1/loads?include=core", timeout=10)["loads"]
        out[spec.name] = {"num_used_tokens": sum(int(load.get("core", load).get("num_used_tokens", 0))
                                                 for load in loads)}
    return out


def flush(router_url: str, headers: dict, timeout_s: float = 30.0) -> dict[str, int]:
    """The router's /flush_cache (waits up to ``timeout_s`` for idle): each backend's status,
    by server URL; the router's own refusal as {"router": status}."""
    req = urllib.request.Request(f"{router_url}/flush_cache?timeout={timeout_s:g}", data=b"", method="POST",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s + 60) as resp:
            reply = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        reply = json.loads(e.read() or b"{}")
        if not reply.get("backends"):
            return {"router": e.code}
    return {url: int(code) for url, code in reply["backends"].items()}


def log_offsets(log_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in Path(log_dir).glob("*.log")}


def leak_warnings(log_dir: Path, since: dict[str, int]) -> list[str]:
    """Leak lines SGLang's idle checks wrote to the servers' logs after ``since`` (log_offsets)."""
    found = []
    for path in sorted(Path(log_dir).glob("*.log")):
        with open(path, "rb") as f:
            f.seek(since.get(path.name, 0))
            for line in f.read().decode(errors="replace").splitlines():
                if any(marker in line for marker in LEAK_MARKERS):
                    found.append(f"{path.stem}: {line.strip()[:300]}")
    return found


def scrape(router_url: str, timeout_s: float = 10.0) -> dict[MetricKey, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{router_url}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    return counters((s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
                    for s in family.samples)


def backend_view(router_url: str, headers: dict, url: str) -> Optional[dict]:
    """The router's row for one backend (GET /pdd/backends), None if it has none."""
    req = urllib.request.Request(f"{router_url}/pdd/backends", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        rows = json.loads(resp.read())["backends"]
    return next((row for row in rows if row["url"] == url), None)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def leftovers(pids: Iterable[int], namespace: Optional[str], veth: Optional[str]) -> list[str]:
    """Processes of the run still alive (any in their process groups too), its namespace and
    veth if they still exist."""
    found = []
    groups = set(pids)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pgid = os.getpgid(int(entry.name))
        except OSError:
            continue
        if pgid in groups and _alive(int(entry.name)):
            found.append(f"process {entry.name} (group {pgid}) still runs")
    if namespace is not None:
        import subprocess

        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        if namespace in names.split():
            found.append(f"namespace {namespace} still exists")
    if veth is not None and Path(f"/sys/class/net/{veth}").exists():
        found.append(f"veth {veth} still exists")
    return found
