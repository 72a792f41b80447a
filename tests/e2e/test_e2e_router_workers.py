"""``--workers N`` with the real CLI: two full routers behind one port, each loading SGLang's
serving layer (the unit tests of the supervisor are in unit/router/test_router_workers.py)."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import REPO_ROOT
from tests.support.fake_backends import Fakes, truth
from tests.support.processes import wait_gone

from sglang_pdd.launcher.cluster import default_model_path
from sglang_pdd.launcher.topology import free_port

# two router processes each load SGLang's serving layer: minutes on the shared CPU box
pytestmark = pytest.mark.e2e


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
            "--main", f"{fakes.md_url},{fakes.md_url},127.0.0.1:1", "--control-key-file", str(key), cwd=REPO_ROOT,
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
            if len(children) == n and urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read() is not None:
                # every worker listens once each has bound the port (they load the tokenizer first)
                listening = {c.pid for c in children
                             if any(conn.laddr.port == port and conn.status == "LISTEN" for conn in c.net_connections())}
                if len(listening) == n:
                    return [c.pid for c in children]
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError("router workers did not come up")
