"""What sglang-pdd refuses at start (P, RLD and MD alike), with the pool or the layer named.

Checked in every scheduler of a server started with --pdd-role, once its model and pools exist,
so a model PDD cannot serve stops the server before it takes a request (never at a request,
never half-way through a transfer):

* Mamba / linear-attention state (``HybridLinearKVPool``, a ``MambaPool`` beside the request
  pool): a recurrent state per request, not KV pages a radix cache can share;
* DeepSeek-V4's ``DeepSeekV4TokenToKVPool`` (compressed pages, window state and a request-state
  ring): the WAN channel moves full pages and a sliding window, not its request-state group
  (kv_buffer_groups.py moves it between pools; docs/data_path.md, "Hybrid pools"); its model
  path also needs CUDA kernels;
* an ``SWAKVPool`` the WAN path does not move yet: sub-pools other than two MHA pools, no
  full-attention layer, no sliding window size. An SWAKVPool of two MHA pools is served, at
  any page size: full layers per page, the sliding layers' window's pages only
  (kv_pool_view.py, md/ingest.py);
* attention sinks (gpt-oss, GraniteSWA) on SGLang's ``torch_native`` backend, the CPU one: its
  ``forward_extend`` takes no ``sinks`` (TypeError at the first prefill otherwise).
"""

from __future__ import annotations

from typing import Iterable, Optional

from sglang_pdd.sglang_glue.kv_buffer_groups import is_hybrid, pool_type, refusal
from sglang_pdd.sglang_glue.kv_pool_view import is_swa_pool


class NotServable(RuntimeError):
    pass


def sink_layers(named_modules: Iterable[tuple[str, object]]) -> list[str]:
    """Names of the modules that carry attention sinks (a ``sinks`` tensor)."""
    import torch

    return [name for name, module in named_modules if isinstance(getattr(module, "sinks", None), torch.Tensor)]


def swa_refusal(kv_pool, page_size: int, window: int) -> Optional[str]:
    """Why the WAN path cannot move this SWAKVPool (None if it can)."""
    from sglang_pdd.sglang_glue.kv_pool_view import UnsupportedKvPool, pool_layout

    try:
        pool_layout(kv_pool, page_size, window)
    except UnsupportedKvPool as e:
        return f"sglang-pdd cannot move this model's KV: {e}; serve it with plain SGLang PD"
    return None


def why_not_servable(kv_pool, req_to_token_pool, attention_backend: str, named_modules=(), page_size: int = 1,
                     window: int = 0) -> Optional[str]:
    """Why a PDD role cannot serve this model (None if it can); ``window``: the scheduler's
    sliding window (SGLang's ``sliding_window_size``)."""
    reason = refusal(kv_pool, req_to_token_pool)
    if reason:
        return reason
    if is_swa_pool(kv_pool):
        reason = swa_refusal(kv_pool, page_size, window)
        if reason:
            return reason
    elif is_hybrid(kv_pool):
        state = ", plus request state" if hasattr(kv_pool, "get_request_state_buf_infos") else ""
        return (f"sglang-pdd cannot move this model's KV yet: its {pool_type(kv_pool)} is a hybrid pool (full-"
                f"attention pages plus sliding-window state{state}), and the WAN channel moves MHA and MLA pools "
                f"and SWAKVPools of two MHA pools only; serve it with plain SGLang PD")
    if attention_backend == "torch_native":
        sinks = sink_layers(named_modules)
        if sinks:
            more = f" and {len(sinks) - 1} more" if len(sinks) > 1 else ""
            return (f"sglang-pdd cannot serve this model on torch_native: its attention takes sinks "
                    f"({sinks[0]}{more}), which SGLang's torch_native attention backend does not support; "
                    f"start it with a backend that does (not available on CPU)")
    return None


def check_scheduler(scheduler) -> None:
    """Raise NotServable (the server exits with the message) when this PDD role cannot serve
    the scheduler's model."""
    model = getattr(getattr(scheduler.tp_worker, "model_runner", None), "model", None)
    allocator = scheduler.token_to_kv_pool_allocator
    reason = why_not_servable(allocator.get_kvcache(), scheduler.req_to_token_pool,
                              str(getattr(scheduler.server_args, "attention_backend", "")),
                              model.named_modules() if model is not None else (), allocator.page_size,
                              int(getattr(scheduler, "sliding_window_size", None) or 0))
    if reason:
        raise NotServable(reason)
