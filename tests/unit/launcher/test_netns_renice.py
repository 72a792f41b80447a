"""``renice_namespace`` on a real namespace (root): every thread inside, started before the call,
gets the nice value; nothing outside does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_pdd.launcher import netns

THREADED = ("import threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n")


def thread_nices(pid: int) -> list[int]:
    # /proc/PID/task/TID/stat field 19 is the nice value; the comm field may hold spaces, so split after ')'
    return [int(Path(t, "stat").read_text().rsplit(")", 1)[1].split()[16]) for t in Path(f"/proc/{pid}/task").iterdir()]


def test_every_thread_in_the_namespace_is_reniced_and_nothing_outside():
    if netns.unavailable_reason():
        pytest.skip(netns.unavailable_reason())
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    with netns.DatacenterLink(10) as link:
        inside = subprocess.Popen(["ip", "netns", "exec", link.namespace, sys.executable, "-c", THREADED],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert inside.stdout.readline().strip() == "up"
            assert netns.pids_in(link.namespace) == [inside.pid]  # `ip netns exec` execs in place
            assert len(thread_nices(inside.pid)) == 2 and set(thread_nices(inside.pid)) == {mine}
            assert netns.renice_namespace(link.namespace, 7) == 2
            assert thread_nices(inside.pid) == [7, 7]
            assert os.getpriority(os.PRIO_PROCESS, 0) == mine
        finally:
            inside.kill()
            inside.wait()
