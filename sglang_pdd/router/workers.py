"""``--workers N``: N router processes serving one port (SO_REUSEPORT).

The supervisor (the process the operator started) checks the port is free, starts N workers,
each a full router (``python -m sglang_pdd.router`` with the same flags) bound to the port with
SO_REUSEPORT so the kernel spreads incoming connections over them, and forwards SIGINT and
SIGTERM to them. If one worker exits the others are stopped and the supervisor exits with that
worker's status: a deployment's process manager sees one service that is up or down, never a
router running at a fraction of its capacity. What each worker keeps to itself: docs/router.md.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

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


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The router's own command line for one worker: ``--workers`` dropped, ``--reuse-port`` added."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--workers":
            skip = True
            continue
        if arg.startswith("--workers="):
            continue
        out.append(arg)
    return [sys.executable, "-m", "sglang_pdd.router", *out, "--reuse-port"]


def _worker_setup() -> None:
    """In the worker before exec: its own process group (a terminal's Ctrl-C reaches the
    supervisor, which forwards it once) and SIGTERM when the supervisor dies (no orphans)."""
    import ctypes
    import os

    os.setpgrp()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def supervise(commands: Sequence[Sequence[str]], poll_s: float = 0.2) -> int:
    """Runs ``commands`` (one per worker) until one exits or a signal comes; returns the exit
    status to report: the first worker's to exit (128 + N for a worker killed by signal N, as a
    shell reports it), 0 after a signal to the supervisor."""
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
        procs.extend(subprocess.Popen(list(cmd), preexec_fn=_worker_setup) for cmd in commands)
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


def run_workers(n: int, host: str, port: int, argv: Sequence[str]) -> int:
    check_port_free(host, port)
    return supervise([worker_argv(argv)] * n)
