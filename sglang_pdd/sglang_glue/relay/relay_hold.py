"""Test-only: RLD stops decoding once a request has a chosen number of output tokens, so a test
can let MD take over at exactly that point.

A pause asked for over HTTP (SGLang's /pause_generation) lands a few to tens of tokens after
the client saw the token it reacted to; on a loaded machine RLD had finished 20-40-token
outputs by then, and the handoff the test was about never happened. Here RLD pauses itself,
on its scheduler thread, before the next decode step.

Armed by ``arm(path, N)``: N written whole (a temporary file renamed over the path) to the file
named by SGLANG_PDD_TEST_RELAY_HOLD_FILE, an environment
variable read when the relay server starts (never per request, as injected_delays.py: no client
can reach it). At the first scheduler iteration where a running request has N or more output
ids, RLD pauses in place (what /pause_generation mode "in_place" does) and renames the file to
``<file>.held``, holding that request's output length: the hold fires once per arming.
/continue_generation resumes RLD as after any pause. Unset: nothing is checked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Iterable, Mapping, Optional

logger = logging.getLogger(__name__)

RELAY_HOLD_FILE_ENV = "SGLANG_PDD_TEST_RELAY_HOLD_FILE"
HELD_SUFFIX = ".held"


def arm(path: str, at: int) -> None:
    """Arms the hold at ``at`` tokens. Renamed into place, never written in place: RLD polls the
    file every scheduler iteration and would otherwise read it empty between its creation and
    its write."""
    tmp = f"{path}.arming"
    with open(tmp, "w") as f:
        f.write(str(at))
    os.replace(tmp, path)


def reached(armed_at: int, output_lengths: Iterable[int]) -> Optional[int]:
    """The output length of a running request that reached ``armed_at`` tokens, if any."""
    return next((n for n in output_lengths if n >= armed_at), None)


class RelayHold:
    def __init__(self, path: str):
        self.path = path

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Optional["RelayHold"]:
        path = environ.get(RELAY_HOLD_FILE_ENV)
        if not path:
            return None
        logger.warning("TEST-ONLY relay hold active: %s=%s (RLD pauses itself when armed)", RELAY_HOLD_FILE_ENV, path)
        return cls(path)

    def armed_at(self) -> Optional[int]:
        try:  # never through a symlink: the hold reads and writes only files of its own directory
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.error("relay hold: %s is not a plain file (%s); disarmed", self.path, e)
            os.remove(self.path)
            return None
        with os.fdopen(fd) as f:
            text = f.read(64).strip()
        if not text:  # being written by a writer that does not rename: not armed yet, not bad
            return None
        try:
            return int(text)
        except ValueError:
            logger.error("relay hold: %s holds %r, not a token count; disarmed", self.path, text)
            os.remove(self.path)
            return None

    def check(self, scheduler) -> None:
        """Once per scheduler iteration, after its input is taken and before it decodes."""
        if scheduler._engine_paused:
            return
        at = self.armed_at()
        if at is None:
            return
        running = (len(r.output_ids) for r in scheduler.running_batch.reqs if not r.finished())
        length = reached(at, running)
        if length is None:
            return
        scheduler._engine_paused = True  # as Scheduler.pause_generation(mode="in_place")
        if scheduler._pause_started_at is None:
            scheduler._pause_started_at = time.monotonic()
        with contextlib.suppress(FileNotFoundError):  # disarmed meanwhile: it fired all the same
            os.remove(self.path)  # fires once per arming, whatever follows
        tmp = self.path + HELD_SUFFIX + ".tmp"
        try:  # a file this call creates, never one planted there (a symlink is not followed)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            logger.error("relay hold: paused, but %s is already there (%s): not written", tmp, e)
            return
        with os.fdopen(fd, "w") as f:
            f.write(str(length))
        os.replace(tmp, self.path + HELD_SUFFIX)  # a reader sees it whole; replaces a link, never its target
        logger.warning("relay hold: paused with a request at %d output tokens (armed at %d)", length, at)
