"""Child-process supervision: start with a log file each, wait for health, stop without orphans.

Every child runs in its own process group (start_new_session), so stopping it also stops the
scheduler / detokenizer subprocesses SGLang forks; an atexit hook and SIGTERM handler make sure
a crashed launcher leaves nothing behind.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)


class ProcessFailed(RuntimeError):
    """A child exited or never became healthy; the message includes the tail of its log."""


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    health_url: Optional[str] = None
    env: dict[str, str] = field(default_factory=dict)
    popen: Optional[subprocess.Popen] = None

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


class ProcessGroup:
    """Owns a set of child processes; use as a context manager."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, ManagedProcess] = {}
        atexit.register(self.stop_all)

    def start(self, name: str, argv: list[str], health_url: Optional[str] = None,
              env: Optional[dict[str, str]] = None) -> ManagedProcess:
        if name in self.procs:
            raise ValueError(f"process {name!r} already started")
        proc = ManagedProcess(name, argv, self.log_dir / f"{name}.log", health_url, env or {})
        log = open(proc.log_path, "ab", buffering=0)
        log.write(f"$ {' '.join(argv)}\n".encode())
        proc.popen = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **proc.env}, start_new_session=True,
        )
        log.close()  # the child holds its own descriptor
        self.procs[name] = proc
        logger.info("started %s (pid %d), log %s", name, proc.popen.pid, proc.log_path)
        return proc

    def wait_healthy(self, names: Optional[list[str]] = None, timeout_s: float = 300.0,
                     progress=None) -> None:
        """Block until every named process answers its health URL; fail fast if one dies."""
        pending = {n for n in (names or self.procs) if self.procs[n].health_url}
        deadline = time.monotonic() + timeout_s
        while pending:
            for name in sorted(pending):
                proc = self.procs[name]
                if proc.popen.poll() is not None:
                    raise ProcessFailed(f"{name} exited with code {proc.popen.returncode} before "
                                        f"becoming healthy; log {proc.log_path}:\n{proc.log_tail()}")
                if _http_ok(proc.health_url):
                    pending.discard(name)
                    if progress is not None:
                        progress(name)
            if pending and time.monotonic() > deadline:
                name = sorted(pending)[0]
                raise ProcessFailed(f"{name} not healthy after {timeout_s:.0f}s; log "
                                    f"{self.procs[name].log_path}:\n{self.procs[name].log_tail()}")
            if pending:
                time.sleep(0.5)

    def check_alive(self) -> None:
        for proc in self.procs.values():
            if proc.popen.poll() is not None:
                raise ProcessFailed(f"{proc.name} exited with code {proc.popen.returncode}; "
                                    f"log {proc.log_path}:\n{proc.log_tail()}")

    def stop(self, name: str, grace_s: float = 10.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.popen is None:
            return
        _stop_group(proc.popen, grace_s)
        logger.info("stopped %s", name)

    def stop_all(self, grace_s: float = 10.0) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name, grace_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_all()


def _stop_group(popen: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the child's whole process group, then SIGKILL what is left after grace_s."""
    try:
        pgid = os.getpgid(popen.pid)
    except ProcessLookupError:
        popen.poll()
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        try:
            popen.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; make sure its children (scheduler, detokenizer) are too.
        if not _group_alive(pgid):
            break
        time.sleep(0.2)
        if not _group_alive(pgid):
            break


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def python_argv(*args: str) -> list[str]:
    return [sys.executable, *args]
