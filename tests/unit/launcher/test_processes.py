"""The launcher's process supervision: health waits, clear failures, and no orphans, ever."""

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tests.conftest import REPO_ROOT
from tests.support.waiting import wait_until

from sglang_pdd.launcher.processes import ProcessFailed, ProcessGroup

MARK = "pdd-test-sleeper"


def alive(marker: str) -> int:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return len(out.split())


def sleeper(marker: str, ignore_term: bool = False) -> list[str]:
    code = textwrap.dedent(f"""
        import signal, subprocess, sys, time
        {'signal.signal(signal.SIGTERM, signal.SIG_IGN)' if ignore_term else ''}
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # {marker}"])
        time.sleep(120)  # {marker}
    """)
    return [sys.executable, "-c", code]


def test_stop_all_kills_children_and_grandchildren_even_if_they_ignore_sigterm(tmp_path):
    marker = f"{MARK}-a"
    with ProcessGroup(tmp_path) as group:
        group.start("stubborn", sleeper(marker, ignore_term=True))
        group.start("polite", sleeper(marker))
        assert wait_until(lambda: alive(marker) == 4)  # both sleepers and their children
        group.stop_all(grace_s=0.5)
    assert wait_until(lambda: alive(marker) == 0)


def test_killed_launcher_leaves_no_orphans(tmp_path):
    marker = f"{MARK}-b"
    argv_file = tmp_path / "child.json"
    argv_file.write_text(json.dumps(sleeper(marker)))  # keeps the marker off the launcher's own argv
    launcher = textwrap.dedent(f"""
        import json, sys, time
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from pathlib import Path
        from sglang_pdd.launcher.processes import ProcessGroup
        group = ProcessGroup(Path({str(tmp_path)!r}))
        group.start("child", json.loads(Path({str(argv_file)!r}).read_text()))
        print("started", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    assert wait_until(lambda: alive(marker) == 2)  # the child and its own child
    proc.kill()  # SIGKILL: no handler runs; the child dies with its parent (PDEATHSIG)
    proc.wait()
    assert wait_until(lambda: alive(marker) <= 1)  # the direct child is gone at once
    subprocess.run(["pkill", "-f", marker])  # a grandchild of a SIGKILLed tree is outside our reach


def test_child_dying_before_healthy_fails_with_its_log(tmp_path):
    with ProcessGroup(tmp_path) as group:
        group.start("broken", [sys.executable, "-c", "print('bad flag --pdd-role'); raise SystemExit(2)"],
                    health_url="http://127.0.0.1:9/health")
        with pytest.raises(ProcessFailed, match=r"broken exited with code 2(.|\n)*bad flag --pdd-role"):
            group.wait_healthy(timeout_s=20)


def test_duplicate_name_rejected(tmp_path):
    with ProcessGroup(tmp_path) as group:
        group.start("one", [sys.executable, "-c", "pass"])
        with pytest.raises(ValueError, match="already started"):
            group.start("one", [sys.executable, "-c", "pass"])


def health_server(marker: str) -> tuple[list[str], str]:
    """A child that forks a grandchild (as SGLang forks its scheduler) and answers GET /health."""
    from sglang_pdd.launcher.topology import free_port

    port = free_port()
    code = textwrap.dedent(f"""
        import http.server, subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # {marker}"])
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404); self.end_headers()
            def log_message(self, *a): pass
        print("serving  # {marker}", flush=True)
        http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
    """)
    return [sys.executable, "-c", code], f"http://127.0.0.1:{port}/health"


def state_of(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_kill_takes_the_whole_group_and_start_again_brings_it_back_with_the_same_command(tmp_path):
    marker = f"{MARK}-c"
    argv, health = health_server(marker)
    with ProcessGroup(tmp_path) as group:
        first = group.start("srv", argv, health_url=health, env={"PDD_TEST_ENV": "kept"})
        group.wait_healthy(timeout_s=30)
        assert wait_until(lambda: alive(marker) == 2)  # the server and its grandchild
        with pytest.raises(ValueError, match="still runs"):
            group.start_again("srv")
        group.kill("srv")
        assert first.popen.returncode == -9  # reaped: a crash, not a clean exit
        assert wait_until(lambda: alive(marker) == 0)  # the grandchild died with it
        again = group.start_again("srv", timeout_s=30)  # returns once /health answers
        assert again.popen.pid != first.popen.pid and again.argv == argv and again.env == {"PDD_TEST_ENV": "kept"}
        assert wait_until(lambda: alive(marker) == 2)
        lines = (tmp_path / "srv.log").read_text().splitlines()
        assert lines.count(f"serving  # {marker}") == 2  # one log, appended to
    assert wait_until(lambda: alive(marker) == 0)


def test_signal_reaches_the_group_and_restart_replaces_a_running_process(tmp_path):
    marker = f"{MARK}-d"
    argv, health = health_server(marker)
    with ProcessGroup(tmp_path) as group:
        first = group.start("srv", argv, health_url=health)
        group.wait_healthy(timeout_s=30)
        group.signal("srv", signal.SIGSTOP)
        assert wait_until(lambda: state_of(first.popen.pid) == "T")
        group.signal("srv", signal.SIGCONT)
        assert wait_until(lambda: state_of(first.popen.pid) != "T")
        again = group.restart("srv", grace_s=5, timeout_s=30)
        assert first.popen.returncode is not None and again.popen.poll() is None
        assert wait_until(lambda: alive(marker) == 2)  # the old group gone, the new one up
    assert wait_until(lambda: alive(marker) == 0)
