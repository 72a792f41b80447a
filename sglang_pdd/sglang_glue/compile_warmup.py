"""Compile SGLang's lazily compiled sampling kernels while the server starts.

SGLang wraps ``apply_scaling_penalties`` (``repetition_penalty``) in ``torch.compile``: the
first request that uses it compiles it on the scheduler thread, which then serves nothing for
seconds (measured: 9-22 s on a loaded 2-core CPU, ~5 s idle). On one server that is a slow
first request. In PDD it also runs a request's clocks: P or RLD stalls while MD's KV wait and
the router's WAN timeout tick, so the request falls back to RLD and its WAN transfer is wasted.
Each P, RLD and MD therefore compiles these kernels before it reports healthy. (SGLang's other
compiled sampling kernel, ``multinomial_with_seed``, serves only seeded sampling; it is left to
its first request rather than lengthen every start.)
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)

# torch.compile(dynamic=True) specialises a size of 1: one request, two, and any more are the
# graphs a server meets; a pass over these sizes compiles each of them.
WARM_BATCH_SIZES = (1, 2, 3)
MAX_PASSES = 3


def warm_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes logits may come in: float32, and the model's when SGLang keeps logits in it."""
    return (torch.float32,) if model_dtype == torch.float32 else (torch.float32, model_dtype)


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


def warm_sampling_kernels(device: str, vocab_size: int, model_dtype: torch.dtype) -> float:
    """Call each compiled sampling kernel on every batch-size class, pass after pass, until a
    pass compiles nothing (what the server's requests will then find); seconds spent."""
    from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

    started = time.perf_counter()
    vocab = max(2, vocab_size)
    for dtype in warm_dtypes(model_dtype):
        for _ in range(MAX_PASSES):
            before = _frames_compiled()
            for batch in WARM_BATCH_SIZES:
                logits = torch.empty(batch, vocab, device=device, dtype=dtype).uniform_(-1.0, 1.0)
                apply_scaling_penalties(logits, torch.full((batch, vocab), 1.25, device=device, dtype=dtype))
            if _frames_compiled() == before:
                break
    spent = time.perf_counter() - started
    logger.info("sglang-pdd: compiled SGLang's sampling kernels in %.1f s (else paid by the first request "
                "with repetition_penalty)", spent)
    return spent
