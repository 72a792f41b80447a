"""Inter-token gaps simulated per decode step, without an event per token.

A decode instance's step time is piecewise constant: it changes only when its batch changes
(a sequence joins or leaves) or an extend pass holds the instance. `StepHistory` is told of
every such change by the instance's batch and keeps:

- the gaps of every token decoded there (`metrics.GapSamples`, shared by a run's instances):
  while the batch is unchanged each of its n sequences gets one token per step, so a segment
  over which every sequence advanced dv tokens adds weight n * dv at the value `step`: one
  (value, weight) pair per batch change, the same distribution as one sample per token;
- a pause of P seconds (an extend) adds P to the token each sequence running then was
  decoding: weight n at `step + P` in place of n tokens at `step`;
- each running sequence's longest gap: the step times since it joined, as a monotone stack
  (segment index, value) with decreasing values, so the largest since any segment is one
  bisection. Entries older than every running sequence's first segment are dropped.

Tokens whose gap is accounted for elsewhere are taken off the next segments' weight (the
`debt`): a sequence's first token when that gap is a handoff stall (the cluster records the
stall itself), the unfinished token of a sequence stopped mid-step (its time is part of the
stall that follows), and the tokens a pause lengthened.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Dict

from .metrics import GapSamples

_EPS = 1e-9


class StepHistory:
    """One decode instance's step times (see the module docstring)."""

    def __init__(self, samples: GapSamples) -> None:
        self.samples = samples
        self._values, self._weights = samples.values, samples.weights
        self.n = 0  # sequences progressing in the current segment
        self.step = 0.0  # its step time (s)
        self.v0 = 0.0  # the batch's virtual time (tokens per sequence) at its start
        self.seg = 0  # index of the last segment on the stack
        self.paused = False
        self._pause_t0 = 0.0
        self._pause_n = 0  # sequences mid-token when the pause began
        self._pause_step = 0.0
        self.debt = 0.0  # tokens to take off the next segments' weight
        self._idx: list = []  # monotone stack: segment indices ...
        self._val: list = []  # ... and their gap values, strictly decreasing
        self._pushes = 0  # since the last trim
        self.start: Dict[Any, int] = {}  # running sequence -> its first segment
        self.exit_gap: Dict[Any, float] = {}  # sequence that left -> its longest gap here

    # ---- what the batch reports ----------------------------------------------------------
    def changed(self, now: float, v: float, n: int, step: float, paused_until: float) -> None:
        """The batch now has n sequences stepping every `step` s, or none progress before
        `paused_until` (an extend); v is its virtual time now."""
        if self.n and not self.paused:  # the segment that ends now, less any debt (hot: inlined)
            w = self.n * (v - self.v0)
            if self.debt > 0.0:
                d = self.debt if self.debt < w else w
                w -= d
                self.debt -= d
            if w > _EPS:
                values = self._values
                if values and values[-1] == self.step:
                    self._weights[-1] += w
                else:
                    values.append(self.step)
                    self._weights.append(w)
        self.v0 = v
        if n and now + _EPS < paused_until:
            if not self.paused:
                self.paused = True
                self._pause_t0, self._pause_n, self._pause_step = now, self.n, self.step
                self._push(self._pause_step + paused_until - now)
            else:  # a later extend lengthened the pause: the entry is still the stack's last
                self._raise_last(self._pause_step + paused_until - self._pause_t0)
            self.n = n
            return
        if self.paused:
            self.paused = False
            gap = self._pause_step + now - self._pause_t0
            self._raise_last(gap)
            if self._pause_n:
                self.samples.add(gap, float(self._pause_n))
                self.debt += self._pause_n
        self.n, self.step = n, step
        if not n:
            self._idx.clear()  # nobody runs: no history is needed
            self._val.clear()
            return
        self._push(step)

    def joined(self, job: Any) -> None:
        """After the change that added `job`: its first segment is the current one, or the
        one after a pause (the gap it waits through is its first token's, counted by the
        caller as a stall)."""
        self.start[job] = self.seg + 1 if self.paused else self.seg

    def left(self, job: Any) -> None:
        """Before the change that removes `job`: its longest gap here goes to exit_gap."""
        q = self.start.pop(job)
        i = bisect_left(self._idx, q)
        self.exit_gap[job] = self._val[i] if i < len(self._idx) else 0.0

    def owe(self, tokens: float) -> None:
        """`tokens` of the work decoded here are gaps counted elsewhere."""
        self.debt += tokens

    # ---- internals -------------------------------------------------------------------
    def _push(self, value: float) -> None:
        self.seg += 1
        idx, val = self._idx, self._val
        while val and val[-1] <= value:
            val.pop()
            idx.pop()
        idx.append(self.seg)
        val.append(value)
        self._pushes += 1
        if self._pushes > 64 and self._pushes > len(self.start):
            self._trim()

    def _raise_last(self, value: float) -> None:
        idx, val = self._idx, self._val
        if value <= val[-1]:
            return
        seg = idx.pop()
        val.pop()
        while val and val[-1] <= value:
            val.pop()
            idx.pop()
        idx.append(seg)
        val.append(value)

    def _trim(self) -> None:
        """Drop what no running sequence can ask for: entries before the oldest first segment.
        It costs O(batch), so it runs once per max(64, batch) pushes: O(1) per push."""
        self._pushes = 0
        oldest = min(self.start.values()) if self.start else self.seg
        cut = bisect_left(self._idx, oldest)
        if cut:
            del self._idx[:cut]
            del self._val[:cut]
