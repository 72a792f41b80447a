"""A launcher killed with SIGKILL leaves its namespace and veth behind (no handler runs); the
next run removes them, and the processes that were inside, before it makes its own, and
leaves nothing of its own when it ends. Real namespaces (root), the demo's real servers
starting inside one."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from tests.support.waiting import wait_until

from tests.conftest import REPO_ROOT, _require_sglang
from sglang_pdd.launcher import netns

pytestmark = [pytest.mark.e2e, pytest.mark.full, pytest.mark.own_cluster]


def owned_by(pid: int) -> list[tuple[str, str]]:
    return [(kind, name) for kind, name, owner, _ in netns.project_leftovers() if owner.pid == pid]


@pytest.fixture
def root_only():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)


def test_killed_launcher_is_swept_by_the_next_run(tmp_path, servers_under_test, root_only):
    _require_sglang()
    servers_under_test.stop()  # the demo starts its own servers
    demo = subprocess.Popen([sys.executable, "-m", "sglang_pdd.launcher.demo", "--netns", "--keep-running",
                             "--run-dir", str(tmp_path / "demo")], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # its namespace exists and MD runs inside it
        assert wait_until(lambda: any(kind == "netns" for kind, _ in owned_by(demo.pid)), timeout=60, poll_s=0.2)
        namespace = next(name for kind, name in owned_by(demo.pid) if kind == "netns")
        inside = lambda: subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,  # noqa: E731
                                        text=True).stdout.split()
        assert wait_until(inside, timeout=120, poll_s=0.5)
        md_pids = [int(p) for p in inside()]
    finally:
        demo.send_signal(signal.SIGKILL)  # no handler, no atexit: nothing cleans up
        demo.wait()
    assert {kind for kind, _ in owned_by(demo.pid)} == {"netns", "veth"}  # left behind
    assert all(not alive for _, _, owner, alive in netns.project_leftovers() if owner.pid == demo.pid)

    with netns.DatacenterLink(10) as link:  # the next run: sweeps, then makes its own
        assert owned_by(demo.pid) == []
        assert [kind for kind, _ in owned_by(link.plan.owner.pid)] == ["netns", "veth"]
        mine = link.namespace
    assert wait_until(lambda: all(netns.process_start_ticks(p) is None for p in md_pids), timeout=30, poll_s=0.2)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert namespace not in names and mine not in names
    assert f"pdd{demo.pid}a" not in links and f"pdd{demo.pid}b" not in links
