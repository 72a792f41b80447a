"""``--workers N``: N router processes on one port (SO_REUSEPORT) under a supervisor."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from tests.conftest import REPO_ROOT
from tests.support.processes import wait_gone

from sglang_pdd.router.front.workers import check_port_free, worker_argv

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

SUPERVISOR = "import sys; from sglang_pdd.router.front.workers import supervise; sys.exit(supervise({cmds!r}))"


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
    return subprocess.Popen([sys.executable, "-c", SUPERVISOR.format(cmds=[cmd, cmd])], cwd=REPO_ROOT)


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


# ---------------------------------------------------------------------------- secrets and shared drains
def test_secrets_reach_workers_in_their_environment_never_on_their_argv(monkeypatch):
    """--api-key, --backend-api-key and --ssl-keyfile-password were copied onto every worker's
    argv (readable by every local user in /proc/PID/cmdline). The supervisor now drops them,
    however the flag is spelled, and hands them over in the workers' environment."""
    from sglang_pdd.router.front import client_auth
    from sglang_pdd.router.front import workers
    argv = ["--tokenizer-path", "m", "--api-key", "k-client", "--backend-api-k=k-backend", "--workers", "2",
            "--ssl-keyfile-password", "k-tls", "--api-key-file", "/keys/none", "--port", "1"]
    cmd = worker_argv(argv, ["k-client", "k-backend", "k-tls"])
    assert not any(s in " ".join(cmd) for s in ("k-client", "k-backend", "k-tls", "--workers"))
    assert cmd[3:] == ["--tokenizer-path", "m", "--api-key-file", "/keys/none", "--port", "1", "--reuse-port"]

    seen = {}

    def fake_supervise(commands, poll_s=0.2, env=None):
        seen.update(commands=commands, env=dict(env), shared=os.path.isdir(env[shared_drain.ENV]))
        return 0

    from sglang_pdd.router.front import shared_drain
    monkeypatch.setattr(workers, "supervise", fake_supervise)
    port = free_port()
    secrets = {client_auth.SECRET_ENV["api_key"]: "k-client", client_auth.SECRET_ENV["backend_api_key"]: "k-backend"}
    assert workers.run_workers(2, "127.0.0.1", port, ["--api-key", "k-client", "--backend-api-key", "k-backend"],
                               secrets) == 0
    assert all("k-client" not in c and "k-backend" not in c for c in seen["commands"])
    assert seen["env"][client_auth.SECRET_ENV["api_key"]] == "k-client" and seen["shared"]
    assert not os.path.exists(seen["env"][shared_drain.ENV])  # the drains' directory goes with the supervisor


def test_a_worker_takes_its_secrets_from_the_environment_and_forgets_them():
    from sglang_pdd.router.front import client_auth
    from sglang_pdd.router.front.cli import parse_args

    base = ["--tokenizer-path", "m", "--relay", "http://r:1", "--prefill", "http://p:1,10"]
    env = {client_auth.SECRET_ENV["api_key"]: "k-client", "OTHER": "x"}
    args = parse_args(base)
    assert client_auth.resolve_secrets(args, env) == [] and args.api_key == "k-client"
    assert env == {"OTHER": "x"}  # not passed on to anything this worker starts
    args = parse_args(base + ["--api-key", "on-argv"])
    assert "readable by every local user" in client_auth.resolve_secrets(args, {})[0]
    assert client_auth.secrets_for_workers(args) == {client_auth.SECRET_ENV["api_key"]: "on-argv"}


def test_a_drain_posted_to_one_worker_reaches_every_worker(tmp_path):
    """With --workers N a drain used to reach only the worker that took the call, which kept
    (N-1)/N of the traffic on the backend. Workers now share drains through a file."""
    from tests.support.fake_backends import serve_app
    from tests.support.flow_scenarios import flow_config

    from sglang_pdd.router.front.app import Router, build_app
    from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
    from sglang_pdd.router.backends.pools import Pools
    from sglang_pdd.router.front.shared_drain import SharedDrains

    md = "http://md:30002"

    def router() -> Router:
        pools = Pools([PrefillBackend("http://p:1", 1)], ["http://rld:1"], [MainBackend(md, "http://md:1", "md:3")])
        return Router(pools, flow_config(), None, max_prompt_tokens=100, served_model="m",
                      every_client_is_operator=True, health_check_interval_s=0,
                      shared_drains=SharedDrains(str(tmp_path)))

    def draining(r: Router) -> bool:
        return r.pools.health.view(("main", md), time.monotonic()).draining

    async def run():
        import aiohttp

        a, b = router(), router()
        async with serve_app(build_app(a)) as url_a, serve_app(build_app(b)), aiohttp.ClientSession() as client:
            for want in (True, False):
                async with client.post(f"{url_a}/pdd/backends/drain", json={"url": md, "draining": want}) as resp:
                    assert resp.status == 200
                assert draining(a) is want
                deadline = time.monotonic() + 5
                while draining(b) is not want and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert draining(b) is want

    asyncio.run(asyncio.wait_for(run(), 30))
