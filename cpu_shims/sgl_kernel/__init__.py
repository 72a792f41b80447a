"""Plain-torch stand-in for ``sgl_kernel`` on CPUs without AMX (no CPU build is on PyPI).

SGLang's CPU path imports two kernels outside AMX-guarded code; they are implemented here
with torch / numpy. Every other name resolves to a function that raises, so modules that
import optional kernels (speculative decoding) still import, and fail loudly only if used.
Installed into the venv by scripts/setup.sh via a .pth file; never used on GPU deployments.
"""

import ctypes

import numpy as np
import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """req_to_token[row, start:end] = the next (end - start) slots of out_cache_loc, per request."""
    cursor = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    ):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[cursor : cursor + n].to(
            req_to_token.dtype
        )
        cursor += n


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every KV buffer (raw pointer + row stride in bytes) copy rows src_loc -> tgt_loc."""
    if len(src_loc) == 0:
        return
    src = src_loc.to(torch.int64).numpy()
    tgt = tgt_loc.to(torch.int64).numpy()
    rows = int(max(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        view = np.ctypeslib.as_array(raw).reshape(rows, stride)
        view[tgt] = view[src]  # fancy indexing reads all sources first: safe in place


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU stand-in (sglang-pdd cpu_shims); "
            "this code path needs a real sgl_kernel build"
        )

    _missing.__name__ = name
    return _missing
