"""``--disaggregation-transfer-backend pdd``: SGLang's KV transfer contracts, two paths per room.

P and RLD run SGLang's own PD prefill/decode code unchanged; only the transfer backend differs.
It is SGLang's Mooncake backend (bootstrap, metadata, aux data, abort, heartbeats: all reused
by subclassing, nothing re-implemented) plus:

* the intra-DC engine: Mooncake's TransferEngine (RDMA in production, TCP in tests) or, when
  Mooncake is not installed or ``--pdd-intra-dc-transport tcp`` asks for it, the
  ``TcpTransferEngine`` of kv_channel — the same one-sided writes over authenticated TCP;
* on P (``--pdd-role prefill``), the WAN path: every page the sender is given also goes to
  the request's WAN destination (p/wan_fanout.py), pipelined with chunked prefill.

Registered through SGLang's transfer-backend registry (patches/sglang-0002-...), so the
servers need no other change. The one HookRegistry hook this needs is in plugin.py: SGLang
builds a sender without the request, so the hook binds the request (prompt ids, the
router's WAN destination) right after PrefillBootstrapQueue.create_sender.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.mooncake.conn import (
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_pdd.config import (PddConfig, PddConfigError, admission_limits, control_names, get_pdd_config,
                               parse_host_port, parse_peer_list)
from sglang_pdd.control.auth import ROLE_P, ControlVerifier
from sglang_pdd.machine import Driver, nothing
from sglang_pdd.sglang_glue.p import wan_binding
from sglang_pdd.kv_channel.fallback import MOONCAKE, intra_dc_transport
from sglang_pdd.kv_channel.handshake import KeyFileError, load_key
from sglang_pdd.kv_channel.tls import control_server_names, control_tls_context, wan_tls_context
from sglang_pdd.kv_channel.tp_relayout import TpShard
from sglang_pdd.protocol import LegParams
from sglang_pdd.sglang_glue.p.prefill_control import DROPPED, DestinationBoard, PrefillControlServer
from sglang_pdd.sglang_glue.p.wan_fanout import WanDestination, WanFanout, WanRoom

logger = logging.getLogger(__name__)

BACKEND_NAME = "pdd"


def read_key(cfg: PddConfig) -> bytes:
    if not cfg.wan_key_file:
        raise PddConfigError("the TCP KV paths need --pdd-wan-key-file (peers authenticate with it)")
    try:
        return load_key(cfg.wan_key_file)
    except KeyFileError as e:
        raise PddConfigError(f"--pdd-wan-key-file: {e}") from None


def _local_host() -> str:
    from sglang.srt.utils.network import get_local_ip_auto

    return get_local_ip_auto()


class PddKVManager(MooncakeKVManager):
    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend: Optional[bool] = False):
        self.pdd_config = get_pdd_config(server_args)
        self.intra_dc_transport = intra_dc_transport(self.pdd_config.intra_dc_transport)
        self.wan_fanout: Optional[WanFanout] = None
        self.wan_destinations: Optional[DestinationBoard] = None
        self.control_server: Optional[PrefillControlServer] = None
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if disaggregation_mode == DisaggregationMode.PREFILL and self.pdd_config.role == "prefill":
            cfg = self.pdd_config
            peers = parse_peer_list("--pdd-wan-peers", cfg.wan_peers) if cfg.wan_peers else frozenset()
            if not peers:
                logger.warning("no --pdd-wan-peers: this P sends KV to no MD; RLD finishes every request")
            # With TP each rank sends its KV heads' share of every room (tp_relayout.py), under its
            # own sender name (MD treats a known name with a new session as a restarted peer).
            self.tp_shard = TpShard(self.attn_tp_rank, self.attn_tp_size,
                                    1 if is_mla_backend else int(getattr(args, "total_kv_head_num", 1) or 1))
            rank_tag = f"-tp{self.attn_tp_rank}" if self.attn_tp_size > 1 else ""
            self.wan_fanout = WanFanout(
                read_key(cfg), f"prefill-{cfg.datacenter or 'a'}-{server_args.port}{rank_tag}",
                num_streams=cfg.wan_streams, timeout_s=cfg.wan_timeout_s,
                staging_bytes=cfg.wan_staging_mb << 20, allowed_peers=peers, max_md_tp=cfg.max_md_tp,
                ssl_context=wan_tls_context(cfg.wan_tls_cert, cfg.wan_tls_key, cfg.wan_tls_ca, server_side=False))
            if cfg.control_listen:  # late destinations: the router need not wait for MD first
                self.wan_destinations = DestinationBoard()
                host, port = parse_host_port("--pdd-control-listen", cfg.control_listen)
                self.control_server = PrefillControlServer(  # rank r on port + r; the router finds them all
                    self.wan_destinations, host, port + self.attn_tp_rank,
                    auth=ControlVerifier(read_key(cfg), role=ROLE_P), peer_allowed=self.wan_fanout.allows,
                    max_md_tp=cfg.max_md_tp, ssl_context=control_tls_context(
                        cfg.control_tls_cert, cfg.control_tls_key, cfg.control_tls_ca, server_side=True),
                    trusted_sources=cfg.control_trusted_sources,
                    names=control_server_names(host, control_names(cfg), cfg.control_tls_cert) or None,
                    stats=self.wan_fanout.stats, tp_rank=self.attn_tp_rank, tp_size=self.attn_tp_size,
                    keep_only=self.wan_fanout.keep_only,
                    # What a rank sends depends on each destination's MD TP size, so every rank
                    # keeps every destination; one whose heads other ranks send drops it (bind_request).
                    sends_wan=True)
        logger.info("pdd transfer backend: %s, intra-DC engine %s%s", disaggregation_mode.value,
                    self.intra_dc_transport, ", WAN fan-out on" if self.wan_fanout else "")

    def init_engine(self):
        if self.intra_dc_transport == MOONCAKE:
            from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
                get_mooncake_transfer_engine,
                init_mooncake_transfer_engine,
            )

            # SGLang initialises the shared engine only for backend "mooncake".
            self.engine = get_mooncake_transfer_engine() or init_mooncake_transfer_engine(
                hostname=_local_host(), gpu_id=self.kv_args.gpu_id,
                ib_device=self.server_args.disaggregation_ib_device)
        else:
            from sglang_pdd.kv_channel.tcp_engine import TcpTransferEngine

            self.engine = TcpTransferEngine(_local_host(), read_key(self.pdd_config),
                                            name=f"pdd-{self.disaggregation_mode.value}",
                                            admission=admission_limits(self.pdd_config))


class PddKVSender(MooncakeKVSender):
    """Mooncake's sender to RLD, plus the request's WAN leg when the router asked for one.

    The WAN destination is known at bind time (``pdd_wan_peer`` in the request) or comes
    later through P's control API (``pdd_wan_expected``); pages given before it arrives are
    remembered (ids only: P keeps the KV, its release waits for the destination up to
    ``--pdd-wan-destination-wait-ms``). The WAN binding's state is ``sglang_glue/p/wan_binding.py``'s machine;
    this class feeds it events (``_BINDING.step``, under ``_wan_lock``) and performs its actions
    (the methods the driver's table names).
    """

    _binding: Optional[wan_binding.BindingState] = None  # None: this request has no WAN binding on this rank
    _wan_room: Optional[WanRoom] = None
    _token_ids: tuple = ()
    _rid: str = ""
    _rld_prefix_len: int = 0
    _page_size: int = 1

    def bind_request(self, req, token_to_kv_pool, page_size: int, window: int = 0) -> None:
        """Called right after SGLang builds this sender (plugin hook): what the request
        carries that the sender contract does not pass (``window``: the model's sliding
        window, for a hybrid pool)."""
        mgr = self.kv_mgr
        params = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
        try:
            dest = WanDestination.from_custom_params(params)
        except ValueError as e:  # the request still runs; RLD finishes it
            logger.warning("rid %s: no WAN leg: %s", req.rid, e)
            return
        expected = LegParams.expects_destination(params)
        late = expected and mgr.wan_destinations is not None
        if mgr.wan_fanout is None or (dest is None and not late):
            if expected and mgr.wan_destinations is None:
                logger.warning("rid %s: a late WAN destination was promised but this P has no "
                               "--pdd-control-listen; RLD finishes the request", req.rid)
            return
        mgr.wan_fanout.attach_pool(token_to_kv_pool, page_size, mgr.tp_shard, window)
        if dest is not None and not mgr.wan_fanout.sends_to(dest.md_tp):
            return  # other P ranks send this rank's heads to an MD on that TP (a late one: _on_destination)
        self._wan_lock = threading.Lock()
        self._pending_pages: list = []
        self._token_ids, self._rid, self._page_size = tuple(req.origin_input_ids), req.rid, page_size
        self._binding = wan_binding.bound(dest)
        if dest is None:
            posted = mgr.wan_destinations.wait_for(self.bootstrap_room, self._on_destination)
            if posted is not None:
                self._on_destination(posted)

    def _on_destination(self, value) -> None:
        """The router's late destination (or its withdrawal); any thread."""
        with self._wan_lock:
            if value is DROPPED:
                _BINDING.step(self, wan_binding.Withdrawn())
            elif not self.kv_mgr.wan_fanout.sends_to(value.md_tp):
                _BINDING.step(self, wan_binding.Withdrawn(f"other P ranks send this rank's KV heads to an MD on TP {value.md_tp}"))
            else:
                _BINDING.step(self, wan_binding.Posted(value))

    # ---- the binding's actions (under _wan_lock), performed by _BINDING
    def _abort_room(self, action: wan_binding.AbortRoom) -> None:
        self.kv_mgr.wan_fanout.abort(self._wan_room, action.why)

    def _unbind(self, action: wan_binding.Unbind) -> None:
        logger.info("rid %s: no WAN leg (%s)", self._rid, action.why)
        self._pending_pages = []

    def _forget_destination(self, action: wan_binding.ForgetDestination) -> None:
        if self.kv_mgr.wan_destinations is not None:
            self.kv_mgr.wan_destinations.forget(self.bootstrap_room)

    def _count_wait_expired(self, action: wan_binding.CountWaitExpired) -> None:
        self.kv_mgr.wan_fanout.counters["destination_wait_expired"] += 1

    def _open_room(self, action: wan_binding.OpenRoom) -> None:
        fanout = self.kv_mgr.wan_fanout
        self._wan_room = fanout.open_room(self._binding.dest, rid=self._rid, token_ids=self._token_ids,
                                          first_offered_page=self._rld_prefix_len // self._page_size)
        if self._wan_room is None:
            _BINDING.step(self, wan_binding.FanoutRefused())
            return
        _BINDING.step(self, wan_binding.FanoutOpened())
        for pages, event, last in self._pending_pages:
            fanout.offer(self._wan_room, pages, event, last=last)
        self._pending_pages = []

    def pop_decode_prefix_len(self) -> int:
        self._rld_prefix_len = super().pop_decode_prefix_len()
        return self._rld_prefix_len

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        super().init(num_kv_indices, aux_index)
        if self._binding is not None:
            with self._wan_lock:
                _BINDING.step(self, wan_binding.Initialized())

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None, indices_event=None):
        wait_event = self._early_send_wait_event  # super() consumes it
        last = self.curr_idx + len(kv_indices) == self.num_kv_indices
        super().send(kv_indices, state_indices, num_kv_tokens=num_kv_tokens, indices_event=indices_event)
        if self._binding is None:
            return
        with self._wan_lock:
            if self._binding.phase is wan_binding.BindingPhase.OPEN:
                self.kv_mgr.wan_fanout.offer(self._wan_room, kv_indices, indices_event or wait_event, last=last)
            elif self._binding.live:
                self._pending_pages.append((kv_indices, indices_event or wait_event, last))

    def _poll_with_status(self, check_status) -> KVPoll:
        status = super()._poll_with_status(check_status)
        if status not in (KVPoll.Success, KVPoll.Failed) or self._binding is None:
            return status
        # P frees the pages once this says Success/Failed: hold that until the WAN copy has
        # them, or (bounded) until a promised destination arrives.
        with self._wan_lock:
            if not self._binding.live:
                return status
            holds = self._binding.phase is wan_binding.BindingPhase.OPEN and not self.kv_mgr.wan_fanout.may_free_pages(self._wan_room)
            actions = _BINDING.step(self, wan_binding.Polled(time.monotonic(), status == KVPoll.Success,
                                                             self.kv_mgr.pdd_config.wan_destination_wait_ms / 1000, holds))
        return KVPoll.Transferring if wan_binding.HoldPages() in actions else status

    def abort(self):
        if self._binding is not None:
            with self._wan_lock:
                _BINDING.step(self, wan_binding.RequestAborted())
        super().abort()


# The WAN binding's one way to change: its machine, and PddKVSender's method for each action.
_BINDING = Driver(wan_binding.transition, {
    wan_binding.OpenRoom: PddKVSender._open_room,
    wan_binding.AbortRoom: PddKVSender._abort_room,
    wan_binding.Unbind: PddKVSender._unbind,
    wan_binding.ForgetDestination: PddKVSender._forget_destination,
    wan_binding.CountWaitExpired: PddKVSender._count_wait_expired,
    wan_binding.HoldPages: nothing,  # the poll reads it from step's answer
}, state="_binding")


class PddKVReceiver(MooncakeKVReceiver):
    """RLD's side is Mooncake's receiver; only the manager's engine may differ."""


class PddKVBootstrapServer(MooncakeKVBootstrapServer):
    pass


def backend_classes() -> dict:
    from sglang.srt.disaggregation.utils import KVClassType

    return {
        KVClassType.MANAGER: PddKVManager,
        KVClassType.SENDER: PddKVSender,
        KVClassType.RECEIVER: PddKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: PddKVBootstrapServer,
    }
