"""``--disaggregation-transfer-backend pdd``: SGLang's KV transfer contracts, two paths per room.

P and RLD run SGLang's own PD prefill/decode code unchanged; only the transfer backend differs.
It is SGLang's Mooncake backend (bootstrap, metadata, aux data, abort, heartbeats: all reused
by subclassing, nothing re-implemented) plus:

* the intra-DC engine: Mooncake's TransferEngine (RDMA in production, TCP in tests) or, when
  Mooncake is not installed or ``--pdd-intra-dc-transport tcp`` asks for it, the
  ``TcpTransferEngine`` of kv_channel — the same one-sided writes over authenticated TCP;
* on P (``--pdd-role prefill``), the WAN path: every page the sender is given also goes to
  the request's WAN destination (wan_fanout.py), pipelined with chunked prefill.

Registered through SGLang's transfer-backend registry (patches/sglang-0002-...), so the
servers need no other change. The one HookRegistry hook this needs is in plugin.py: SGLang
builds a sender without the request, so the hook binds the request (prompt ids, the
router's WAN destination) right after PrefillBootstrapQueue.create_sender.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.mooncake.conn import (
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_pdd.config import PddConfig, PddConfigError
from sglang_pdd.kv_channel.fallback import MOONCAKE, TCP, intra_dc_transport
from sglang_pdd.sglang_glue.wan_fanout import WanDestination, WanFanout, WanRoom

logger = logging.getLogger(__name__)

BACKEND_NAME = "pdd"


def read_key(cfg: PddConfig) -> bytes:
    if not cfg.wan_key_file:
        raise PddConfigError("the TCP KV paths need --pdd-wan-key-file (peers authenticate with it)")
    key = Path(cfg.wan_key_file).read_bytes().strip()
    if len(key) < 16:
        raise PddConfigError(f"--pdd-wan-key-file {cfg.wan_key_file} holds {len(key)} bytes; need >= 16")
    return key


def _local_host() -> str:
    from sglang.srt.utils.network import get_local_ip_auto

    return get_local_ip_auto()


class PddKVManager(MooncakeKVManager):
    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend: Optional[bool] = False):
        from sglang_pdd.sglang_glue.plugin import get_pdd_config

        self.pdd_config = get_pdd_config(server_args)
        self.intra_dc_transport = intra_dc_transport(self.pdd_config.intra_dc_transport)
        self.wan_fanout: Optional[WanFanout] = None
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if disaggregation_mode == DisaggregationMode.PREFILL and self.pdd_config.role == "prefill":
            cfg = self.pdd_config
            self.wan_fanout = WanFanout(
                read_key(cfg), f"prefill-{cfg.datacenter or 'a'}-{server_args.port}",
                num_streams=cfg.wan_streams, timeout_s=cfg.wan_timeout_s,
                staging_bytes=cfg.wan_staging_mb << 20)
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
                                            name=f"pdd-{self.disaggregation_mode.value}")


class PddKVSender(MooncakeKVSender):
    """Mooncake's sender to RLD, plus the request's WAN leg when the router named one."""

    _wan_dest: Optional[WanDestination] = None
    _wan_room: Optional[WanRoom] = None
    _token_ids: tuple = ()
    _rid: str = ""
    _rld_prefix_len: int = 0
    _page_size: int = 1

    def bind_request(self, req, token_to_kv_pool, page_size: int) -> None:
        """Called right after SGLang builds this sender (plugin hook): what the request
        carries that the sender contract does not pass."""
        fanout = self.kv_mgr.wan_fanout
        params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        dest = WanDestination.from_custom_params(params)
        if fanout is None or dest is None:
            return
        fanout.attach_pool(token_to_kv_pool, page_size)
        self._wan_dest, self._token_ids, self._rid = dest, tuple(req.origin_input_ids), req.rid
        self._page_size = page_size

    def pop_decode_prefix_len(self) -> int:
        self._rld_prefix_len = super().pop_decode_prefix_len()
        return self._rld_prefix_len

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        super().init(num_kv_indices, aux_index)
        if self._wan_dest is not None and self._wan_room is None:
            self._wan_room = self.kv_mgr.wan_fanout.open_room(
                self._wan_dest, rid=self._rid, token_ids=self._token_ids,
                first_offered_page=self._rld_prefix_len // self._page_size)

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None, indices_event=None):
        wait_event = self._early_send_wait_event  # super() consumes it
        last = self.curr_idx + len(kv_indices) == self.num_kv_indices
        super().send(kv_indices, state_indices, num_kv_tokens=num_kv_tokens, indices_event=indices_event)
        if self._wan_room is not None:
            self.kv_mgr.wan_fanout.offer(self._wan_room, kv_indices, indices_event or wait_event, last=last)

    def _poll_with_status(self, check_status) -> KVPoll:
        status = super()._poll_with_status(check_status)
        # P frees the pages once this says Success/Failed: hold that until the WAN copy has them.
        if status in (KVPoll.Success, KVPoll.Failed) and self._wan_room is not None:
            if not self.kv_mgr.wan_fanout.may_free_pages(self._wan_room):
                return KVPoll.Transferring
        return status

    def abort(self):
        if self._wan_room is not None:
            self.kv_mgr.wan_fanout.abort(self._wan_room, "request aborted on P")
        super().abort()


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
