"""P (``--pdd-role prefill``): fan each request's KV out to MD over the WAN, beside Mooncake.

SGLang's own Mooncake backend still carries the KV to RLD unchanged; this adds the second path.
When a request's prefill completes (the last ``send_kv_chunk``), the KV rows MD lacks
(``[pdd_md_prefix_len, prompt_len)``) are copied out of the pool on the scheduler thread (they
are freed once RLD has them) and handed to a sender thread, so the scheduler never waits on
the WAN. The router names the destination per request in ``sampling_params.custom_params``:
``pdd_room`` (MD's room), ``pdd_wan_peer`` (HOST:PORT) and ``pdd_md_prefix_len``.

Failure is always safe: if the fan-out is backlogged or the WAN fails, MD's room fails or times
out and RLD finishes the request.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Optional

from sglang_pdd.config import PddConfig, parse_host_port
from sglang_pdd.kv_channel.wan_sender import WanKvSender
from sglang_pdd.sglang_glue.kv_pool_view import gather_rows, kv_layout_of

logger = logging.getLogger(__name__)

MAX_QUEUED_TRANSFERS = 64  # bounded: each queued item holds a copy of a request's KV


@dataclass(frozen=True)
class WanTarget:
    room: int
    peer: tuple[str, int]
    md_prefix_len: int

    @classmethod
    def from_custom_params(cls, params) -> Optional["WanTarget"]:
        if not isinstance(params, dict) or "pdd_wan_peer" not in params:
            return None
        return cls(int(params["pdd_room"]), parse_host_port("pdd_wan_peer", str(params["pdd_wan_peer"])),
                   int(params.get("pdd_md_prefix_len", 0)))


class PrefillWanFanout:
    def __init__(self, cfg: PddConfig, key: bytes, name: str):
        self.cfg, self.key, self.name = cfg, key, name
        self.senders: dict[tuple[str, int], WanKvSender] = {}
        self.jobs: "queue.Queue" = queue.Queue(maxsize=MAX_QUEUED_TRANSFERS)
        self.counters = {"transfers": 0, "dropped_backlog": 0, "bytes": 0}
        self.thread = threading.Thread(target=self._run, name="pdd-wan-fanout", daemon=True)
        self.thread.start()

    def on_last_chunk(self, scheduler, req) -> None:
        params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        target = WanTarget.from_custom_params(params)
        if target is None:
            return
        prompt_len = len(req.origin_input_ids)
        start = min(max(target.md_prefix_len, 0), prompt_len - 1)
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        layout = kv_layout_of(pool, scheduler.page_size)
        slots = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:prompt_len]
        rows = gather_rows(pool, slots)
        job = (target, layout, prompt_len, start, list(req.origin_input_ids), req.rid, rows)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.counters["dropped_backlog"] += 1
            logger.warning("room %s: WAN fan-out backlog full (%d); MD will time out and RLD finishes",
                           target.room, MAX_QUEUED_TRANSFERS)

    def _sender(self, peer) -> WanKvSender:
        sender = self.senders.get(peer)
        if sender is None:
            sender = WanKvSender(peer, self.key, name=self.name, num_streams=self.cfg.wan_streams,
                                 transfer_timeout=self.cfg.wan_timeout_s,
                                 idle_timeout=min(10.0, self.cfg.wan_timeout_s))
            self.senders[peer] = sender
        return sender

    def _run(self) -> None:
        inflight = []  # (transfer, rows): rows must outlive the zero-copy send
        while True:
            try:
                job = self.jobs.get(timeout=0.5)
            except queue.Empty:
                job = None
            inflight = [(t, rows) for t, rows in inflight if not t.poll().is_terminal]
            if job is None:
                continue
            target, layout, prompt_len, start, token_ids, rid, rows = job
            try:
                transfer = self._sender(target.peer).begin_transfer(
                    target.room, layout, prompt_len, start, request_id=rid or "", token_ids=token_ids,
                    timeout=self.cfg.wan_timeout_s)
                for layer, data in enumerate(rows):
                    if not transfer.send_layer(layer, data.numpy()):
                        break
                transfer.finish()
                inflight.append((transfer, rows))
                self.counters["transfers"] += 1
                self.counters["bytes"] += sum(r.numel() for r in rows)
            except Exception:  # noqa: BLE001 — one bad transfer must not stop the fan-out
                logger.exception("room %s: WAN transfer to %s:%s could not start", target.room, *target.peer)
