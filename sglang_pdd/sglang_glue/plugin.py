"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``pdd``).

SGLang calls ``register()`` in every one of its processes before building ServerArgs or a
Scheduler. It only registers HookRegistry hooks, so importing sglang_pdd alone changes nothing,
and a server started without --pdd-role behaves exactly like plain SGLang.

Hooks (each a no-op unless --pdd-role asks for it):
* ServerArgs.add_cli_args / from_cli_args — the --pdd-* flags and their validation;
* Scheduler.__init__ (after) — start the role's runtime in the scheduler process;
* Scheduler.ingest_requests (after) — SGLang's per-iteration input point: MD drains its
  room commands and WAN completions there, on the scheduler thread;
* SchedulerDisaggregationPrefillMixin.send_kv_chunk (after) — P fans the KV out over the WAN.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_pdd.config import PddConfig, PddConfigError, add_pdd_args, config_from_namespace, validate

logger = logging.getLogger(__name__)

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_PREFILL_MIXIN = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"


def _add_cli_args(original, parser):
    original(parser)
    add_pdd_args(parser)


def _attach_pdd_config(server_args, cls, args):
    """After ServerArgs.from_cli_args: validate the --pdd-* flags and keep them on the record."""
    cfg = config_from_namespace(args)
    try:
        validate(cfg, str(getattr(server_args, "disaggregation_mode", "null")))
    except PddConfigError as e:
        # argparse-style failure: one clear line, before any process is spawned.
        raise SystemExit(f"sglang-pdd: error: {e}") from None
    server_args._pdd_config = cfg
    if cfg.active:
        logger.info("sglang-pdd active: role=%s datacenter=%s", cfg.role, cfg.datacenter or "-")
    return server_args


def get_pdd_config(server_args) -> PddConfig:
    """The PddConfig a server was started with (inactive default when the flags were not used)."""
    return getattr(server_args, "_pdd_config", None) or PddConfig()


def _read_key(cfg: PddConfig) -> bytes:
    key = Path(cfg.wan_key_file).read_bytes().strip()
    if len(key) < 16:
        raise PddConfigError(f"--pdd-wan-key-file {cfg.wan_key_file} holds {len(key)} bytes; need >= 16")
    return key


def _start_role_runtime(result, scheduler, *args, **kwargs):
    cfg = get_pdd_config(scheduler.server_args)
    scheduler._pdd_runtime = None
    if cfg.role == "main":
        from sglang_pdd.sglang_glue.main_drc import MainDrcRuntime

        scheduler._pdd_runtime = MainDrcRuntime(scheduler, cfg, _read_key(cfg))
    elif cfg.role == "prefill":
        from sglang_pdd.sglang_glue.prefill_wan import PrefillWanFanout

        name = f"prefill-{cfg.datacenter or 'a'}-{scheduler.server_args.port}"
        scheduler._pdd_runtime = PrefillWanFanout(cfg, _read_key(cfg), name)


def _after_ingest(result, scheduler, *args, **kwargs):
    runtime = getattr(scheduler, "_pdd_runtime", None)
    if runtime is not None and hasattr(runtime, "on_scheduler_iteration"):
        runtime.on_scheduler_iteration()


def _after_send_kv_chunk(result, scheduler, req, last_chunk=False, end_idx=None):
    runtime = getattr(scheduler, "_pdd_runtime", None)
    if last_chunk and runtime is not None and hasattr(runtime, "on_last_chunk"):
        try:
            runtime.on_last_chunk(scheduler, req)
        except Exception:  # noqa: BLE001 — the WAN copy is best effort; RLD still has the KV
            logger.exception("rid %s: WAN fan-out failed; MD will time out and RLD finishes", req.rid)


def register() -> None:
    HookRegistry.register(f"{_SERVER_ARGS}.add_cli_args", _add_cli_args, HookType.AROUND)
    HookRegistry.register(f"{_SERVER_ARGS}.from_cli_args", _attach_pdd_config, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}.__init__", _start_role_runtime, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}.ingest_requests", _after_ingest, HookType.AFTER)
    HookRegistry.register(f"{_PREFILL_MIXIN}.send_kv_chunk", _after_send_kv_chunk, HookType.AFTER)
