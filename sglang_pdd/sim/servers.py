"""Serving resources: prefill instances, decode instances and the shared WAN link.

Decode batches and the WAN share one structure, `EqualShareServer`: every job in it
advances at the same rate, which depends on how many jobs there are (a decode step gives
each running sequence one token; fair sharing gives each flow link/n bytes/s). A virtual
clock (work done per job since the start) makes that O(log n) per arrival or departure
instead of one event per token or packet, which is what lets us run 100k requests fast.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any, Callable, Dict

from .engine import EventLoop
from .hardware import HardwareProfile, LinkProfile
from .steps import GapSamples, StepHistory

_EPS = 1e-9


class EqualShareServer:
    """Jobs progress together; `rate_fn(n_jobs, weight_sum)` is the per-job rate (work/s)."""

    def __init__(self, loop: EventLoop, rate_fn: Callable[[int, float], float],
                 on_done: Callable[[float, Any], None]) -> None:
        self.loop = loop
        self.rate_fn = rate_fn
        self.on_done = on_done
        self.v = 0.0  # work each job has received since t = 0 (virtual time)
        self.t = 0.0
        self.rate = 0.0
        self.jobs: Dict[Any, tuple] = {}  # job -> (start_v, finish_v, weight)
        self.weight_sum = 0.0
        self.finish_v_sum = 0.0
        self._heap: list = []  # (finish_v, seq, job); stale entries skipped lazily
        self._seq = 0
        self._version = 0
        self.paused_until = 0.0  # no progress before this time (an extend pass holds the chip)
        self.history: "StepHistory | None" = None  # a decode batch's step times (sim/steps.py)

    def __len__(self) -> int:
        return len(self.jobs)

    def _advance(self, now: float) -> None:
        self.v += self.rate * (now - self.t)
        self.t = now

    def add(self, now: float, job: Any, work: float, weight: float = 0.0) -> None:
        self._advance(now)
        fv = self.v + work
        self.jobs[job] = (self.v, fv, weight)
        self.weight_sum += weight
        self.finish_v_sum += fv
        self._seq += 1
        heapq.heappush(self._heap, (fv, self._seq, job))
        self._reschedule(now)
        if self.history is not None:
            self.history.joined(job)

    def remove(self, now: float, job: Any) -> float:
        """Take a job out before it finishes; returns the work it received."""
        self._advance(now)
        start_v, fv, weight = self.jobs.pop(job)
        self.weight_sum -= weight
        self.finish_v_sum -= fv
        if self.history is not None:
            self.history.left(job)
        self._reschedule(now)
        return min(self.v, fv) - start_v

    def progress(self, now: float, job: Any) -> float:
        start_v, fv, _ = self.jobs[job]
        return min(self.v + self.rate * (now - self.t), fv) - start_v

    def pause(self, now: float, until: float) -> None:
        """No job progresses in [now, until): the instance runs something else (an extend)."""
        self._advance(now)
        self.paused_until = max(self.paused_until, until)
        self._reschedule(now)
        self.loop.at(self.paused_until, self._resume, None)

    def _resume(self, now: float, _arg) -> None:
        if now + _EPS < self.paused_until:
            return  # a later pause superseded this one
        self._advance(now)
        self._reschedule(now)

    def remaining_work_total(self, now: float) -> float:
        v = self.v + self.rate * (now - self.t)
        return max(0.0, self.finish_v_sum - len(self.jobs) * v)

    def _reschedule(self, now: float) -> None:
        self._version += 1
        heap, jobs = self._heap, self.jobs
        while heap:  # drop stale tops: jobs gone, or re-added with another finish
            top = heap[0]
            entry = jobs.get(top[2])
            if entry is not None and entry[1] == top[0]:
                break
            heapq.heappop(heap)
        hist = self.history
        if not jobs:
            self.rate = 0.0
            self.weight_sum = 0.0
            self.finish_v_sum = 0.0
            if hist is not None:
                hist.changed(now, self.v, 0, 0.0, self.paused_until)
            return
        if now + _EPS < self.paused_until:
            self.rate = 0.0
            if hist is not None:
                hist.changed(now, self.v, len(self.jobs), 0.0, self.paused_until)
            return
        self.rate = self.rate_fn(len(self.jobs), self.weight_sum)
        if hist is not None:
            hist.changed(now, self.v, len(self.jobs), 1.0 / self.rate, self.paused_until)
        dt = (heap[0][0] - self.v) / self.rate if self.rate > 0 else math.inf
        if math.isfinite(dt):
            self.loop.at(now + max(0.0, dt), self._on_event, self._version)

    def _on_event(self, now: float, version: int) -> None:
        if version != self._version:
            return
        self._advance(now)
        heap, done = self._heap, []
        # Nothing changed since this event was scheduled, so the heap top is due now;
        # snapping v to it avoids re-arming a zero-length event on float round-off.
        self.v = max(self.v, heap[0][0])
        tol = _EPS * max(1.0, abs(self.v))
        while heap and heap[0][0] <= self.v + tol:
            fv, _, job = heapq.heappop(heap)
            entry = self.jobs.get(job)
            if entry is None or entry[1] != fv:
                continue
            del self.jobs[job]
            if self.history is not None:
                self.history.left(job)
            self.weight_sum -= entry[2]
            self.finish_v_sum -= fv
            done.append(job)
        self._reschedule(now)
        for job in done:
            self.on_done(now, job)


class PrefillInstance:
    """Chunked prefill, FIFO: each forward pass packs queued requests' new tokens up to the
    chunk size (small tails batch together; a long prompt takes several passes). A pass
    costs its overhead once, plus `prefill_s_per_extra_request` for every further request
    in it, plus each request's tokens and attention over its own context, plus, in the
    request's first pass, loading its host-tier hit back to HBM (`load_s`)."""

    def __init__(self, loop: EventLoop, hw: HardwareProfile, on_done: Callable[[float, Any], None]) -> None:
        self.loop, self.hw, self.on_done = loop, hw, on_done
        self.queue: deque = deque()  # [job, remaining_new_tokens, ctx_tokens_done, load_s still to pay]
        self.busy = False
        self.queued_tokens = 0
        self.queued_work_s = 0.0  # token and attention time of everything queued
        self.busy_s = 0.0

    def _work_s(self, new_tokens: int, ctx_tokens: int) -> float:
        # Additive over chunks: sum of n_i * (c_i + n_i / 2) over a request's chunks equals
        # N * (ctx + N / 2), so the backlog can subtract each pass's share exactly.
        hw = self.hw
        return new_tokens * hw.prefill_s_per_token + new_tokens * (ctx_tokens + new_tokens / 2.0) * hw.prefill_s_per_token_ctx

    def submit(self, now: float, job: Any, new_tokens: int, cached_tokens: int, load_s: float = 0.0) -> None:
        self.queue.append([job, new_tokens, cached_tokens, load_s])
        self.queued_tokens += new_tokens
        self.queued_work_s += self._work_s(new_tokens, cached_tokens) + load_s
        if not self.busy:
            self._start(now)

    def backlog_s(self) -> float:
        """Time to clear the queue: per-token and attention terms (pass overheads left out)."""
        return self.queued_work_s

    def _start(self, now: float) -> None:
        budget = self.hw.prefill_chunk_tokens
        batch, dur = [], self.hw.prefill_overhead_s
        for item in self.queue:
            if budget <= 0:
                break
            n = min(item[1], budget)
            budget -= n
            batch.append((item, n))
            dur += n * self.hw.prefill_s_per_token + n * (item[2] + n / 2.0) * self.hw.prefill_s_per_token_ctx + item[3]
        if not batch:
            self.busy = False
            return
        dur += (len(batch) - 1) * self.hw.prefill_s_per_extra_request
        self.busy = True
        self.busy_s += dur
        self.loop.after(dur, self._finish_pass, batch)

    def _finish_pass(self, now: float, batch: list) -> None:
        finished = []
        for item, n in batch:
            self.queued_work_s -= self._work_s(n, item[2]) + item[3]
            item[3] = 0.0
            item[1] -= n
            item[2] += n
            self.queued_tokens -= n
        if self.queued_tokens == 0:
            self.queued_work_s = 0.0  # no float drift across an empty queue
        while self.queue and self.queue[0][1] <= 0:
            finished.append(self.queue.popleft()[0])
        self._start(now)
        for job in finished:
            self.on_done(now, job)


class DecodeInstance:
    """Continuous batching with admission by KV memory and batch size (FIFO waiting queue).

    A job reserves its whole final KV (prompt + output) on admission, a conservative
    stand-in for SGLang's incremental allocation with retraction."""

    def __init__(self, loop: EventLoop, hw: HardwareProfile, on_start: Callable[[float, Any], None],
                 on_done: Callable[[float, Any], None], gaps: "GapSamples | None" = None) -> None:
        self.loop, self.hw, self.on_start = loop, hw, on_start
        self._on_done_cb = on_done
        self.batch = EqualShareServer(loop, self._token_rate, self._done)
        # Inter-token gaps of the tokens decoded here, into `gaps` (shared by a run's instances).
        self.history = self.batch.history = StepHistory(gaps if gaps is not None else GapSamples())
        self.waiting: deque = deque()  # (job, tokens_to_decode, ctx_tokens, reserve_tokens)
        self.reserved: Dict[Any, int] = {}
        self.kv_used = 0
        self.waiting_reserve = 0  # KV the waiting queue will need (kept so load() is O(1))
        self._owe_on_join = False

    def _token_rate(self, n: int, kv_tokens: float) -> float:
        return 1.0 / self.hw.decode_step_s(n, int(kv_tokens))

    def load(self) -> float:
        """KV in use plus waiting, as a fraction of the pool (> 1 means a queue)."""
        return (self.kv_used + self.waiting_reserve) / self.hw.kv_capacity_tokens

    def in_flight(self) -> int:
        """Running plus waiting requests (the router's in-flight count for this instance)."""
        return len(self.batch) + len(self.waiting)

    def utilisation(self) -> float:
        """Running plus waiting requests over max running (> 1 means a queue)."""
        return self.in_flight() / self.hw.max_running_requests

    def occupy(self, now: float, seconds: float) -> float:
        """An extend pass of `seconds` on this instance: it waits for earlier extends and
        stalls every running sequence while it runs. Returns when it ends."""
        end = max(now, self.batch.paused_until) + seconds
        self.batch.pause(now, end)
        return end

    def step_s(self) -> float:
        """Current decode step time (one token of every running sequence)."""
        n = len(self.batch)
        return self.hw.decode_step_s(max(1, n), int(self.batch.weight_sum))

    def submit(self, now: float, job: Any, tokens_to_decode: int, ctx_tokens: int) -> None:
        reserve = ctx_tokens + tokens_to_decode
        self.waiting.append((job, tokens_to_decode, ctx_tokens, reserve))
        self.waiting_reserve += reserve
        self._admit(now)

    def can_admit(self, reserve: int) -> bool:
        """Would a job needing `reserve` KV tokens start now (nobody queued ahead of it)?"""
        return (not self.waiting and len(self.batch) < self.hw.max_running_requests
                and (self.kv_used + reserve <= self.hw.kv_capacity_tokens or not self.reserved))

    def is_running(self, job: Any) -> bool:
        return job in self.batch.jobs

    def tokens_done(self, now: float, job: Any) -> int:
        return int(self.batch.progress(now, job) + _EPS)

    def stop(self, now: float, job: Any) -> int:
        """Stop a running job early (handoff); returns the tokens it decoded here."""
        work = self.batch.progress(now, job)
        n = int(work + _EPS)
        if work > n:  # the token it was decoding never comes: that time is the next gap's
            self.history.owe(work - n)
        self.batch.remove(now, job)
        self._release(job)
        self._admit(now)
        return n

    def first_token_elsewhere(self) -> None:
        """From on_start: the job starting now has its first gap counted by the caller (a
        handoff stall), so its first token is not a step sample."""
        self._owe_on_join = True

    def pop_max_gap(self, job: Any) -> float:
        """The longest step (or step plus pause) a job that has left lived through here."""
        return self.history.exit_gap.pop(job, 0.0)

    def _release(self, job: Any) -> None:
        self.kv_used -= self.reserved.pop(job)

    def _admit(self, now: float) -> None:
        hw = self.hw
        while self.waiting:
            job, n, ctx, reserve = self.waiting[0]
            fits = self.kv_used + reserve <= hw.kv_capacity_tokens or not self.reserved
            if len(self.batch) >= hw.max_running_requests or not fits:
                return
            self.waiting.popleft()
            self.waiting_reserve -= reserve
            self.reserved[job] = reserve
            self.kv_used += reserve
            self.on_start(now, job)
            if n <= 0:
                self._release(job)
                self._on_done_cb(now, job)
            else:
                self.batch.add(now, job, n, weight=ctx)
            if self._owe_on_join:
                self._owe_on_join = False
                if n > 0:
                    self.history.owe(1.0)

    def _done(self, now: float, job: Any) -> None:
        self._release(job)
        self._admit(now)
        self._on_done_cb(now, job)


class SharedLink:
    """A link whose in-flight transfers share the rate fairly; then latency (+ jitter).
    With gbps = inf a transfer costs its latency only. `shared=False`: every transfer gets
    the full rate (same-DC RDMA: each P's NICs to each D, no common bottleneck).

    A transfer moved to the background (`to_background`: nobody waits for it any more) shares
    what the foreground leaves, i.e. the whole rate only while no foreground transfer is in
    flight (strict priority)."""

    def __init__(self, loop: EventLoop, link: LinkProfile, rng, on_arrive: Callable[[float, Any], None],
                 shared: bool = True) -> None:
        self.loop, self.link, self.rng, self.on_arrive = loop, link, rng, on_arrive
        self.shared = shared
        self.flows = EqualShareServer(loop, self._flow_rate, self._sent_foreground)
        self.background = EqualShareServer(loop, self._background_rate, self._sent)
        self.bytes_sent = 0.0
        self.bytes_cancelled = 0.0
        self._sizes: Dict[Any, float] = {}

    def _flow_rate(self, n: int, _w: float) -> float:
        return self.link.bytes_per_s / n

    def _background_rate(self, n: int, _w: float) -> float:
        return 0.0 if len(self.flows) else self.link.bytes_per_s / n

    def _latency(self) -> float:
        j = self.link.jitter_s
        return self.link.one_way_latency_s + (self.rng.uniform(0.0, j) if j > 0 else 0.0)

    def _foreground_changed(self, now: float) -> None:
        """The background's rate follows whether the foreground is empty."""
        bg = self.background
        if bg.jobs:
            bg._advance(now)
            bg._reschedule(now)

    def send(self, now: float, job: Any, nbytes: float) -> None:
        if nbytes <= 0 or math.isinf(self.link.gbps) or not self.shared:
            self.bytes_sent += nbytes
            self.loop.after(self._latency() + self.link.serialisation_s(max(0.0, nbytes)), self.on_arrive, job)
            return
        self._sizes[job] = nbytes
        self.flows.add(now, job, nbytes)
        self._foreground_changed(now)

    def in_flight(self, job: Any) -> bool:
        return job in self.flows.jobs or job in self.background.jobs

    def to_background(self, now: float, job: Any) -> None:
        """Nobody waits for this transfer any more: it yields the link to those somebody does."""
        if job not in self.flows.jobs:
            return
        done = self.flows.remove(now, job)
        self.background.add(now, job, max(0.0, self._sizes[job] - done))
        self._foreground_changed(now)

    def cancel(self, now: float, job: Any) -> float:
        """Drop a transfer still serialising; returns the bytes already sent."""
        if job in self.flows.jobs:
            sent = self.flows.remove(now, job)
            self._foreground_changed(now)
        elif job in self.background.jobs:
            start_v, finish_v, _ = self.background.jobs[job]
            sent_before = self._sizes[job] - (finish_v - start_v)  # in the foreground
            sent = sent_before + self.background.remove(now, job)
        else:
            return 0.0
        size = self._sizes.pop(job)
        self.bytes_sent += sent
        self.bytes_cancelled += size - sent
        return sent

    def competing_bytes(self, now: float, own_bytes: float) -> float:
        """Bytes that will share the link with a new transfer of `own_bytes` (fair share:
        each flow competes with at most our size; approximated from the totals)."""
        n = len(self.flows)
        return min(self.flows.remaining_work_total(now), n * own_bytes) if n else 0.0

    def _sent_foreground(self, now: float, job: Any) -> None:
        self._foreground_changed(now)
        self._sent(now, job)

    def _sent(self, now: float, job: Any) -> None:
        self.bytes_sent += self._sizes.pop(job)
        self.loop.after(self._latency(), self.on_arrive, job)
