"""Child-process supervision: start with a log file each, wait for health, stop without orphans.

Every child runs in its own process group (start_new_session), so stopping it also stops the
scheduler / detokenizer subprocesses SGLang forks; an atexit hook and SIGTERM handler make sure
a crashed launcher leaves nothing behind.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import subprocess
import threading
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


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the launcher dies, even by SIGKILL."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


_GROUPS: list["ProcessGroup"] = []


def _stop_groups_and_exit(signum, frame):
    for group in list(_GROUPS):
        group.stop_all()
    raise SystemExit(128 + signum)


class ProcessGroup:
    """Owns a set of child processes; use as a context manager."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, ManagedProcess] = {}
        atexit.register(self.stop_all)
        _GROUPS.append(self)
        # A launcher stopped with SIGTERM/SIGHUP (not only Ctrl-C) still stops its children.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(sig) in (signal.SIG_DFL, None):
                    signal.signal(sig, _stop_groups_and_exit)

    def start(self, name: str, argv: list[str], health_url: Optional[str] = None,
              env: Optional[dict[str, str]] = None) -> ManagedProcess:
        if name in self.procs:
            raise ValueError(f"process {name!r} already started")
        proc = ManagedProcess(name, argv, self.log_dir / f"{name}.log", health_url, env or {})
        log = open(proc.log_path, "ab", buffering=0)
        log.write(f"$ {' '.join(argv)}\n".encode())
        proc.popen = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **proc.env}, start_new_session=True, preexec_fn=_die_with_parent,
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
        self._stop([name], grace_s)

    def signal(self, name: str, sig: int) -> None:
        """``sig`` to the process's whole group (its scheduler and detokenizer too): SIGSTOP /
        SIGCONT, or SIGKILL as a crash would (``kill``)."""
        try:
            os.killpg(self.procs[name].popen.pid, sig)  # its own session: the group is its pid
        except ProcessLookupError:
            pass

    def kill(self, name: str, timeout_s: float = 10.0) -> None:
        """SIGKILL the process's group and reap it; the record stays, for ``start_again``."""
        proc = self.procs[name]
        self.signal(name, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc.popen.poll()
            if not _group_alive(proc.popen.pid):
                break
            time.sleep(0.05)
        proc.popen.poll()
        logger.info("killed %s", name)

    def start_again(self, name: str, timeout_s: float = 600.0) -> ManagedProcess:
        """A process that exited (killed) started again with the same command line and
        environment (its log appended to); returns once it is healthy."""
        old = self.procs[name]
        if old.popen.poll() is None:
            raise ValueError(f"process {name!r} still runs")
        del self.procs[name]
        proc = self.start(name, old.argv, old.health_url, old.env)
        self.wait_healthy([name], timeout_s=timeout_s)
        return proc

    def restart(self, name: str, grace_s: float = 10.0, timeout_s: float = 600.0) -> ManagedProcess:
        """Stop (SIGTERM, SIGKILL after ``grace_s``) and start again with the same command line."""
        old = self.procs[name]
        self.stop(name, grace_s)
        proc = self.start(name, old.argv, old.health_url, old.env)
        self.wait_healthy([name], timeout_s=timeout_s)
        return proc

    def stop_all(self, grace_s: float = 10.0) -> None:
        self._stop(list(self.procs), grace_s)
        if self in _GROUPS:
            _GROUPS.remove(self)

    def _stop(self, names: list[str], grace_s: float) -> None:
        """SIGTERM every named process group at once, SIGKILL what is left after grace_s."""
        procs = [p for p in (self.procs.pop(n, None) for n in names) if p is not None and p.popen]
        groups = {}
        for proc in procs:
            try:
                groups[proc.name] = os.getpgid(proc.popen.pid)
            except ProcessLookupError:
                proc.popen.poll()
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for pgid in groups.values():
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                for proc in procs:
                    proc.popen.poll()  # reap the leader, or its zombie keeps the group "alive"
                if not any(_group_alive(g) for g in groups.values()):
                    break
                time.sleep(0.1)
        for proc in procs:
            proc.popen.poll()  # reap
            logger.info("stopped %s", proc.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_all()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


class ClusterProcesses:
    """A cluster's lifetime as a context manager: ``start()`` (the subclass's; returns the
    cluster) on enter, every process in ``self.procs`` stopped on exit, and also when the start
    fails half way, so no server of a failed start is left running."""

    procs: ProcessGroup

    def start(self):
        raise NotImplementedError

    def stop(self) -> None:
        self.procs.stop_all()

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
