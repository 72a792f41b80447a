"""``--workers N``: N router processes serving one port (SO_REUSEPORT).

The supervisor (the process the operator started) checks the port is free, starts N workers,
each a full router (``python -m sglang_pdd.router`` with the same flags) bound to the port with
SO_REUSEPORT so the kernel spreads incoming connections over them, and forwards SIGINT and
SIGTERM to them. If one worker exits the others are stopped and the supervisor exits with that
worker's status: a deployment's process manager sees one service that is up or down, never a
router running at a fraction of its capacity. Secrets given on the command line reach the
workers in their environment, not on their argv. Operator drains are shared through a
private directory (front/shared_drain.py). What each worker keeps to itself: docs/router.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterable, Optional, Sequence

from sglang_pdd.router.front import shared_drain
STOP_GRACE_S = 15.0


def check_port_free(host: str, port: int) -> None:
    """SystemExit when another process holds ``host:port`` (workers bind it with SO_REUSEPORT,
    which would otherwise share a port with an unrelated router started the same way)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise SystemExit(f"sglang_pdd.router: error: cannot listen on {host}:{port}: {e}") from None


SECRET_FLAGS = ("--api-key", "--backend-api-key", "--ssl-keyfile-password")


def _secret_flag(arg: str) -> bool:
    """``arg`` names a flag whose value is a secret (argparse takes any unambiguous prefix)."""
    return len(arg) > 2 and any(flag.startswith(arg) for flag in SECRET_FLAGS)


def worker_argv(argv: Sequence[str], secrets: Iterable[str] = ()) -> list[str]:
    """The router's own command line for one worker: ``--workers`` dropped, ``--reuse-port``
    added, and each secret flag whose value is in ``secrets`` dropped with it (``--flag VALUE``
    or ``--flag=VALUE``): a worker gets those in its environment, which only its user can
    read, not on its argv, which every local user can."""
    secrets = {s for s in secrets if s}
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        flag, _, inline = arg.partition("=")
        if arg == "--workers" or (_secret_flag(arg) and i + 1 < len(argv) and argv[i + 1] in secrets):
            i += 2
            continue
        if flag == "--workers" and inline or (_secret_flag(flag) and inline in secrets):
            i += 1
            continue
        out.append(arg)
        i += 1
    return [sys.executable, "-m", "sglang_pdd.router", *out, "--reuse-port"]


def _worker_setup() -> None:
    """In the worker before exec: its own process group (a terminal's Ctrl-C reaches the
    supervisor, which forwards it once) and SIGTERM when the supervisor dies (no orphans)."""
    import ctypes
    import os

    os.setpgrp()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def supervise(commands: Sequence[Sequence[str]], poll_s: float = 0.2, env: Optional[dict] = None) -> int:
    """Runs ``commands`` (one per worker, with environment ``env``; None: this process's) until
    one exits or a signal comes; returns the exit status to report: the first worker's to exit
    (128 + N for a worker killed by signal N, as a shell reports it), 0 after a signal to the
    supervisor."""
    procs: list[subprocess.Popen] = []
    stopping: list[int] = []

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    status: Optional[int] = None
    try:
        procs.extend(subprocess.Popen(list(cmd), preexec_fn=_worker_setup, env=env) for cmd in commands)
        while status is None and not stopping:
            for p in procs:
                code = p.poll()
                if code is not None:
                    status = code
                    break
            else:
                time.sleep(poll_s)
        if not stopping:  # a worker died: stop the others
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
    finally:
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if status is None:
        return 0
    return 128 - status if status < 0 else status


def run_workers(n: int, host: str, port: int, argv: Sequence[str], secrets: Optional[dict] = None) -> int:
    """``secrets``: environment variables holding the secrets the workers need (client_auth.
    secrets_for_workers); their values are dropped from the workers' argv. The workers also
    share a private directory for operator drains (front/shared_drain.py)."""
    check_port_free(host, port)
    secrets = secrets or {}
    shared = tempfile.mkdtemp(prefix="sglang-pdd-router-")  # mode 0700
    try:
        env = {**os.environ, **secrets, shared_drain.ENV: shared}
        return supervise([worker_argv(argv, secrets.values())] * n, env=env)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
