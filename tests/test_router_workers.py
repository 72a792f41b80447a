"""``--workers N``: N router processes on one port (SO_REUSEPORT) under a supervisor."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from fake_backends import Fakes, truth

from sglang_pdd.launcher.cluster import default_model_path
from sglang_pdd.router.workers import check_port_free, worker_argv

REPO = Path(__file__).resolve().parents[1]

# A stand-in worker: answers its pid on the shared port (SO_REUSEPORT), as a router worker binds it.
PID_WORKER = textwrap.dedent("""
    import os, sys
    from aiohttp import web
    async def pid(request):
        return web.Response(text=str(os.getpid()))
    app = web.Application()
    app.router.add_get("/", pid)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), reuse_port=True, print=None)
""")

SUPERVISOR = "import sys; from sglang_pdd.router.workers import supervise; sys.exit(supervise({cmds!r}))"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def pids_answering(port: int, want: int, timeout_s: float = 30.0) -> set[str]:
    """The distinct worker pids that answer on ``port`` (new connection each time: the kernel
    spreads connections over the SO_REUSEPORT listeners by their address hash)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < deadline:
        try:
            seen.add(get(f"http://127.0.0.1:{port}/"))
        except OSError:
            time.sleep(0.1)
    return seen


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not reaped by its parent yet) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(int(p)) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_worker_argv_drops_workers_and_binds_with_reuse_port():
    argv = ["--tokenizer-path", "m", "--workers", "4", "--port", "1", "--workers=2"]
    assert worker_argv(argv) == [sys.executable, "-m", "sglang_pdd.router", "--tokenizer-path", "m",
                                 "--port", "1", "--reuse-port"]


def test_a_held_port_is_refused_before_any_worker_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(SystemExit, match="cannot listen"):
            check_port_free("127.0.0.1", s.getsockname()[1])


def two_pid_workers(port: int) -> subprocess.Popen:
    """The supervisor over two workers that answer their pid on ``port``."""
    cmd = [sys.executable, "-c", PID_WORKER, str(port)]
    return subprocess.Popen([sys.executable, "-c", SUPERVISOR.format(cmds=[cmd, cmd])], cwd=REPO)


def test_workers_share_one_port_and_stop_with_the_supervisor():
    port = free_port()
    sup = two_pid_workers(port)
    try:
        pids = pids_answering(port, 2)
        assert len(pids) == 2, pids  # both workers accept on the one port
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(20) == 0
        assert wait_gone(pids)
    finally:
        if sup.poll() is None:
            sup.kill()


def test_one_worker_dying_stops_the_others_and_the_supervisor_reports_it():
    port = free_port()
    sup = two_pid_workers(port)
    try:
        pids = pids_answering(port, 2)
        assert len(pids) == 2, pids
        victim, other = sorted(pids)
        os.kill(int(victim), signal.SIGKILL)
        assert sup.wait(20) == 128 + signal.SIGKILL  # the dead worker's status: a process manager restarts us
        assert wait_gone([other])
    finally:
        if sup.poll() is None:
            sup.kill()


@pytest.mark.e2e  # two router processes each load SGLang's serving layer: minutes on the shared CPU box
def test_router_with_two_workers_serves_the_model_on_one_port(tmp_path, router_sglang_state):
    """The real CLI: two full routers (each loads the tokenizer) behind one port, each request
    answered exactly as by one router, whichever worker took it."""
    key = tmp_path / "control.key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)

    async def main():
        fakes = await Fakes().start()
        port = free_port()
        router = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sglang_pdd.router", "--workers", "2", "--port", str(port),
            "--tokenizer-path", default_model_path(),
            "--prefill", f"{fakes.p_url},8998,{fakes.p_control_url}", "--relay", fakes.rld_url,
            "--main", f"{fakes.md_url},{fakes.md_url},127.0.0.1:1", "--control-key-file", str(key), cwd=REPO,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            loop = asyncio.get_running_loop()
            workers = await loop.run_in_executor(None, wait_for_workers, router.pid, port, 2)
            assert len(workers) == 2
            for i in range(6):
                prompt = list(range(10 + i, 40 + i))
                body = json.dumps({"input_ids": prompt, "sampling_params": {"max_new_tokens": 12}}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body,
                                             {"Content-Type": "application/json"})
                reply = json.loads(await loop.run_in_executor(None, lambda: urllib.request.urlopen(req, timeout=30).read()))
                assert reply["output_ids"] == truth(prompt, 12)
        finally:
            router.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(router.wait(), 30) == 0
            await fakes.stop()
        assert wait_gone(workers)

    asyncio.run(main())


def wait_for_workers(supervisor_pid: int, port: int, n: int, timeout_s: float = 240.0) -> list[int]:
    """The supervisor's worker pids, once the port answers /health and n workers run."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        children = psutil.Process(supervisor_pid).children()
        try:
            if len(children) == n and get(f"http://127.0.0.1:{port}/health") is not None:
                # every worker listens once each has bound the port (they load the tokenizer first)
                listening = {c.pid for c in children
                             if any(conn.laddr.port == port and conn.status == "LISTEN" for conn in c.net_connections())}
                if len(listening) == n:
                    return [c.pid for c in children]
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError("router workers did not come up")
