"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``pdd``).

SGLang calls ``register()`` in every one of its processes before building ServerArgs or a
Scheduler. It only registers HookRegistry hooks, so importing sglang_pdd alone changes nothing,
and a server started without --pdd-role behaves exactly like plain SGLang.

It also registers the ``pdd`` transfer backend (transfer_backend.py) in SGLang's
transfer-backend registry (patches/sglang-0002-...) and adds it to the CLI choices.

Hooks (each a no-op unless --pdd-role asks for it):
* ServerArgs.add_cli_args / from_cli_args — the --pdd-* flags and their validation;
* Scheduler.__init__ (before) — MLA models on ``torch_native`` take SGLang's absorbed MLA
  path (mla_attention.py; the fallback dispatch reads the latent pool as per-head K/V);
* Scheduler.__init__ (after) — refuse a model PDD cannot move (servable.py: Mamba/linear
  state, hybrid sliding-window pools, attention sinks on torch_native), compile SGLang's lazily
  compiled sampling kernels (compile_warmup.py), start MD's runtime in the scheduler process;
* Scheduler.ingest_requests (after) — SGLang's per-iteration input point: MD drains its
  room commands and WAN completions there, on the scheduler thread; a test's relay checks its
  hold there (relay/relay_hold.py, only when started with it);
* PrefillBootstrapQueue.create_sender (after) — give P's ``pdd`` sender the request it
  serves (prompt ids, the router's WAN destination): SGLang builds senders without it;
* SchedulerInvariantChecker._check_full_pool / _check_swa_pool (around) — MD's pool pages
  (and a hybrid pool's sliding-window slots) reserved for KV in flight count as held (SGLang's
  idle leak check would otherwise stop MD's scheduler).
* Scheduler.flush_cache / is_fully_idle and SchedulerFlushWrapper.handle (around) — MD
  flushes only when its rooms hold nothing; rooms kept only to fill the cache go on a
  flush, and a refusal says what MD holds.
* Scheduler.on_idle (after) — MD still sleeps on idle while only its rooms are in flight
  (SGLang sleeps only when fully idle, and the hook above counts rooms as work); P and RLD
  wait on their sockets for up to a millisecond where SGLang spins while KV transfers run.
* Scheduler._create_generation_req / _add_request_to_queue and the penalizers' _prepare —
  md/resume.py: a request marked ``pdd_resume_output_len`` continues as output (inert without
  the marker, which only the router / MD glue sets).
* ScheduleBatch.process_prebuilt (after) / cumulate_penalty_output_tokens (around) —
  relay/penalty_clock.py: on the relay (a PD decode server) penalties count tokens on one server's
  clock (inert on every other role).
"""

from __future__ import annotations

import logging

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_pdd.config import (TRANSFER_BACKEND, PddConfigError, add_pdd_args, config_from_namespace, get_pdd_config,
                               validate)

logger = logging.getLogger(__name__)

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_BOOTSTRAP_QUEUE = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue"
_SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_DECODE_BATCH_MIXIN = "sglang.srt.disaggregation.decode_schedule_batch_mixin.ScheduleBatchDisaggregationDecodeMixin"
_INVARIANT_CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker"
_FLUSH_WRAPPER = "sglang.srt.managers.scheduler_components.flush_wrapper.SchedulerFlushWrapper"


def _add_cli_args(original, parser):
    original(parser)
    add_pdd_args(parser)


def _attach_pdd_config(server_args, cls, args):
    """After ServerArgs.from_cli_args: validate the --pdd-* flags and keep them on the record."""
    cfg = config_from_namespace(args)
    try:
        validate(cfg, str(getattr(server_args, "disaggregation_mode", "null")),
                 str(getattr(server_args, "disaggregation_transfer_backend", "")),
                 tp_size=int(getattr(server_args, "tp_size", 1) or 1))
    except PddConfigError as e:
        # argparse-style failure: one clear line, before any process is spawned.
        raise SystemExit(f"sglang-pdd: error: {e}") from None
    server_args._pdd_config = cfg
    if cfg.active:
        logger.info("sglang-pdd active: role=%s datacenter=%s", cfg.role, cfg.datacenter or "-")
    return server_args


def _start_role_runtime(result, scheduler, *args, **kwargs):
    cfg = get_pdd_config(scheduler.server_args)
    scheduler._pdd_runtime = None
    scheduler._pdd_relay_hold = None
    scheduler._pdd_yields_to_transfers = cfg.role in ("prefill", "relay")
    if cfg.active:
        from sglang_pdd.sglang_glue.servable import check_scheduler

        check_scheduler(scheduler)  # a model PDD cannot move stops here, named (servable.py)
        _warm_compiled_kernels(scheduler)
    if cfg.role == "relay":
        from sglang_pdd.sglang_glue.relay import penalty_clock
        penalty_clock.align_pd_first_step()
        from sglang_pdd.sglang_glue.relay.relay_hold import RelayHold

        scheduler._pdd_relay_hold = RelayHold.from_env()  # test-only; None unless set at the start
    if cfg.role == "main":
        from sglang_pdd.sglang_glue.md.main_drc import MainDrcRuntime
        from sglang_pdd.sglang_glue.transfer_backend import read_key

        scheduler._pdd_runtime = MainDrcRuntime(scheduler, cfg, read_key(cfg))


def _warm_compiled_kernels(scheduler) -> None:
    from sglang_pdd.sglang_glue.compile_warmup import warm_sampling_kernels

    try:
        warm_sampling_kernels(str(scheduler.device), int(scheduler.model_config.vocab_size),
                              scheduler.model_config.dtype)
    except Exception:  # noqa: BLE001 — a failed warm-up only moves the compile to the first request
        logger.exception("sglang-pdd: warming SGLang's compiled sampling kernels failed")


def _mla_dispatch(scheduler, *args, **kwargs):
    from sglang_pdd.sglang_glue.mla_attention import register_torch_native_mla_dispatch

    register_torch_native_mla_dispatch()


def _after_ingest(result, scheduler, *args, **kwargs):
    runtime = getattr(scheduler, "_pdd_runtime", None)
    if runtime is not None and hasattr(runtime, "on_scheduler_iteration"):
        runtime.on_scheduler_iteration()
    hold = getattr(scheduler, "_pdd_relay_hold", None)
    if hold is not None:
        hold.check(scheduler)


def _flush_cache_without_rooms(original, scheduler, *args, **kwargs):
    """SGLang refuses to flush while requests run; MD also while rooms hold prefixes or pool
    pages for KV in flight (MD's control API serves them from another thread)."""
    runtime = getattr(scheduler, "_pdd_runtime", None)
    blocker = runtime.flush_blocker() if runtime is not None else None
    if blocker is not None:
        logger.warning("Cache not flushed because %s", blocker)
        return False
    return original(scheduler, *args, **kwargs)


# How long a flush asked without a timeout waits, on an otherwise idle MD, for the pages of
# rooms that ended to come back (the WAN receiver finishes the chunk it is reading first).
PAGES_BACK_WAIT_S = 10.0


def _flush_request_on_md(original, wrapper, recv_req):
    """SGLang's flush request on MD: rooms kept only to fill the cache go first (the flush
    empties it anyway); a flush then held up only by their pages on the way back waits for
    them (SGLang's own deferred flush) instead of failing; a refusal says what MD holds."""
    scheduler = getattr(getattr(wrapper, "_flush_cache", None), "__self__", None)
    runtime = getattr(scheduler, "_pdd_runtime", None)
    if runtime is None:
        return original(wrapper, recv_req)
    dropped = runtime.before_flush()
    if dropped:
        logger.info("flush: dropped %d PDD rooms whose KV was landing only to be cached", dropped)
    if not recv_req.timeout_s and runtime.flush_waits_only_for_pages() and _sglang_idle(scheduler):
        recv_req.timeout_s = PAGES_BACK_WAIT_S
    out = original(wrapper, recv_req)
    if out is not None and not out.success and not out.message:
        blocker = runtime.flush_blocker()
        if blocker is not None:
            out.message = f"Cache not flushed: {blocker}.\n"
    return out


def _sglang_idle(scheduler) -> bool:
    """SGLang's own verdict (no request running or waiting), without MD's rooms: the method
    HookRegistry wrapped, where it did."""
    is_fully_idle = type(scheduler).is_fully_idle
    return getattr(is_fully_idle, "__wrapped__", is_fully_idle)(scheduler)


def _idle_without_md_rooms(original, scheduler, *args, **kwargs):
    """MD is not idle while its rooms hold prefixes or pages for KV in flight (as SGLang counts
    PD queues), so a deferred flush waits for them too. Health checks are SGLang's alone."""
    idle = original(scheduler, *args, **kwargs)
    if not idle or kwargs.get("for_health_check") or (args and args[0]):
        return idle
    runtime = getattr(scheduler, "_pdd_runtime", None)
    return runtime is None or runtime.flush_blocker() is None


def _sleep_while_md_rooms_land(result, scheduler, *args, **kwargs):
    """SGLang's on_idle sleeps only when fully idle, and MD's rooms in flight count as work (so a
    deferred flush waits for them): without this MD spun a core for as long as KV crossed the
    WAN, taken from P and RLD on a shared machine. Landing KV needs no iteration: idle_wake
    wakes the scheduler when a room settles, a command comes or pages may go back."""
    runtime = getattr(scheduler, "_pdd_runtime", None)
    if runtime is not None and runtime.flush_blocker() is not None and _sglang_idle(scheduler):
        scheduler.maybe_sleep_on_idle()
    return result


# How long P or RLD waits on its sockets per idle iteration while KV transfers run.
TRANSFER_WAIT_POLL_MS = 1


def _yield_while_transfers_wait(result, scheduler, *args, **kwargs):
    """P and RLD with nothing to run but KV transfers in flight (P also while it holds a
    request's pages for its WAN copy): SGLang's on_idle spins there (``time.sleep(0)``), and
    the threads those transfers need (Mooncake's transfer worker, P's WAN fan-out) take the
    GIL back between their I/O calls only at a spinning thread's switch interval. Waiting on
    the scheduler's own sockets instead hands them the GIL and the core; a request that
    comes in still ends the wait at once."""
    if getattr(scheduler, "_pdd_yields_to_transfers", False):
        poller = getattr(getattr(scheduler, "idle_sleeper", None), "poller", None)
        if poller is not None and not _sglang_idle(scheduler):
            poller.poll(TRANSFER_WAIT_POLL_MS)
    return result


def _count_md_held_slots(original, checker, ps, uncached=0):
    """MD reserves pool pages for KV still crossing the WAN (in no request, not yet in the
    tree): SGLang's pool-conservation check counts them with the other uncached tokens."""
    from sglang_pdd.sglang_glue.md.main_drc import held_kv_tokens

    return original(checker, ps, uncached=uncached + held_kv_tokens(checker.token_to_kv_pool_allocator))


def _count_md_held_swa_slots(original, checker, ps, uncached=0):
    """The same for a hybrid pool's sliding-window slots (MD holds them for a room's window)."""
    from sglang_pdd.sglang_glue.md.main_drc import held_swa_kv_tokens

    return original(checker, ps, uncached=uncached + held_swa_kv_tokens(checker.token_to_kv_pool_allocator))


def _bind_sender(created, queue, req, *args, **kwargs):
    sender = getattr(req, "disagg_kv_sender", None) if created else None
    if sender is not None and hasattr(sender, "bind_request"):
        try:
            sender.bind_request(req, queue.token_to_kv_pool, queue.scheduler.token_to_kv_pool_allocator.page_size,
                                int(getattr(queue.scheduler, "sliding_window_size", None) or 0))
        except Exception:  # noqa: BLE001 — without a WAN leg the request still completes on RLD
            logger.exception("rid %s: no WAN leg (binding the request to its sender failed)", req.rid)


def _register_transfer_backend() -> None:
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation import utils

    if not hasattr(utils, "register_transfer_backend"):
        logger.warning("SGLang lacks the transfer-backend registry (patches/sglang-0002-open-transfer-backend-"
                       "registry.patch; run scripts/setup.sh): --disaggregation-transfer-backend %s is "
                       "unavailable", TRANSFER_BACKEND)
        return

    def load_classes():
        from sglang_pdd.sglang_glue.transfer_backend import backend_classes

        return backend_classes()

    utils.register_transfer_backend(TRANSFER_BACKEND, load_classes)
    if TRANSFER_BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        DISAGG_TRANSFER_BACKEND_CHOICES.append(TRANSFER_BACKEND)


def register() -> None:
    _register_transfer_backend()
    HookRegistry.register(f"{_SERVER_ARGS}.add_cli_args", _add_cli_args, HookType.AROUND)
    HookRegistry.register(f"{_SERVER_ARGS}.from_cli_args", _attach_pdd_config, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}.__init__", _mla_dispatch, HookType.BEFORE)
    HookRegistry.register(f"{_SCHEDULER}.__init__", _start_role_runtime, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}.ingest_requests", _after_ingest, HookType.AFTER)
    HookRegistry.register(f"{_BOOTSTRAP_QUEUE}.create_sender", _bind_sender, HookType.AFTER)
    HookRegistry.register(f"{_INVARIANT_CHECKER}._check_full_pool", _count_md_held_slots, HookType.AROUND)
    HookRegistry.register(f"{_INVARIANT_CHECKER}._check_swa_pool", _count_md_held_swa_slots, HookType.AROUND)
    HookRegistry.register(f"{_SCHEDULER}.flush_cache", _flush_cache_without_rooms, HookType.AROUND)
    HookRegistry.register(f"{_SCHEDULER}.is_fully_idle", _idle_without_md_rooms, HookType.AROUND)
    HookRegistry.register(f"{_SCHEDULER}.on_idle", _sleep_while_md_rooms_land, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}.on_idle", _yield_while_transfers_wait, HookType.AFTER)
    HookRegistry.register(f"{_FLUSH_WRAPPER}.handle", _flush_request_on_md, HookType.AROUND)
    _register_resume_hooks()


def _register_resume_hooks() -> None:
    from sglang_pdd.sglang_glue.relay import penalty_clock
    from sglang_pdd.sglang_glue.md import resume
    HookRegistry.register(f"{_SCHEDULER}._create_generation_req", resume.seed_resumed_output, HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULER}._add_request_to_queue", resume.advance_resumed_request, HookType.BEFORE)
    for target, seed in resume.PENALIZER_SEEDS.items():
        HookRegistry.register(target, seed, HookType.AFTER)
    HookRegistry.register(f"{_DECODE_BATCH_MIXIN}.process_prebuilt", penalty_clock.mark_transferred_requests,
                          HookType.AFTER)
    HookRegistry.register(f"{_SCHEDULE_BATCH}.cumulate_penalty_output_tokens", penalty_clock.count_prompt_tail_first,
                          HookType.AROUND)
