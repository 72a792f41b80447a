"""Operator drains shared by every ``--workers`` process: one small JSON file.

With ``--workers N`` each worker keeps its own health board (router/backends/health.py), so a drain
posted to one worker (the kernel picks which) would leave the other N-1 sending the backend
(N-1)/N of the traffic. The supervisor makes a private directory for its workers; a drain
is written there (``{url: draining}``, replaced atomically under a file lock), and every
worker reads the file when it changes (``poll``, every ``POLL_S``), so all of them stop
picking a drained backend within that. Breakers and probes stay each worker's own: each
probes every backend itself.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

POLL_S = 0.5
ENV = "SGLANG_PDD_ROUTER_SHARED_DIR"  # set by the supervisor for its workers


class SharedDrains:
    def __init__(self, directory: str):
        self.path = Path(directory) / "drains.json"
        self._lock_path = Path(directory) / "drains.lock"
        self._seen: Optional[tuple[int, int]] = None  # (mtime_ns, inode) of the version last read

    def set(self, url: str, draining: bool) -> None:
        """Record an operator's drain (or undrain) for every worker."""
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            drains = self._read()
            drains[url] = draining
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".drains-")
            with os.fdopen(fd, "w") as f:
                json.dump(drains, f)
            os.replace(tmp, self.path)

    def poll(self) -> Optional[dict[str, bool]]:
        """Every backend's drain as recorded, if the file changed since the last poll, else None."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        version = (st.st_mtime_ns, st.st_ino)
        if version == self._seen:
            return None
        self._seen = version
        return self._read()

    def _read(self) -> dict[str, bool]:
        try:
            with open(self.path) as f:
                drains = json.load(f)
        except (FileNotFoundError, ValueError):
            return {}
        return {str(u): bool(d) for u, d in drains.items()} if isinstance(drains, dict) else {}


def from_env() -> Optional[SharedDrains]:
    """The workers' shared drains when this process is one of a supervisor's workers."""
    directory = os.environ.get(ENV)
    return SharedDrains(directory) if directory else None
