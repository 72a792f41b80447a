"""SGLang's penalty clock: which tokens the penalizers have counted when a request samples.

Frequency / presence / repetition penalties are cumulated in ``ScheduleBatch.prepare_for_decode``
from ``req.output_ids[-1]`` (``cumulate_penalty_output_tokens``), i.e. from what the scheduler
has *processed* so far. Under the overlap scheduler (SGLang's default) the previous step's
result is processed only after the next step is prepared, so a plain server counts one token
late: when it samples output position j (j >= 1) its penalizers hold

    [prompt[-1], out[0], ..., out[j-2]]       (the first decode falls back to prompt[-1])

and, without overlap, ``[out[0], ..., out[j-1]]``. Measured on this project's tiny model: one
server answers ``repetition_penalty=1.4`` with ``[686, 686, ...]`` (position 1 does not see
position 0's token).

"Behaves exactly as one SGLang server would" therefore means reproducing that clock in the two
places PDD starts a request somewhere other than at its first token:

* MD resuming k tokens (md/resume.py): the penalizers are seeded with ``history(...)`` below, not
  with all k tokens; MD's own next decode step then counts ``out[k-1]``, as the server would.
* RLD, a PD decode server: it gets ``output_ids = [P's first token]`` before its first decode,
  so SGLang counts that token at the first step where one server counts ``prompt[-1]`` (and
  counts it twice in all). ``count_prompt_tail_first`` (hooks below, relay role only) makes the
  first decode after a PD transfer count ``prompt[-1]``, as one server does.
"""

from __future__ import annotations

from typing import Sequence

_FIRST_STEP_ATTR = "_pdd_penalty_counts_prompt_tail"  # on a Req: its next cumulation is prompt[-1]

# Set in the relay's scheduler process (plugin.py): one flag per process, the PD decode server's.
_align_pd_first_step = False


def history(prompt: Sequence[int], output: Sequence[int], overlap: bool) -> list[int]:
    """The tokens one server's penalizers have counted (with multiplicity) when it samples
    output position ``len(output)``."""
    if not output:
        return []
    if not overlap:
        return list(output)
    return [prompt[-1], *output[:-1]]


def align_pd_first_step() -> None:
    """Make this process's PD decode batches follow one server's clock (relay role)."""
    global _align_pd_first_step
    _align_pd_first_step = True


# ---- hooks (HookRegistry; registered in plugin.py) -------------------------------------------

def mark_transferred_requests(result, batch, *args, **kwargs):
    """AFTER ScheduleBatch.process_prebuilt (PD decode): the KV and first token came from P; under
    overlap the next cumulation of each request must be prompt[-1], not P's token."""
    if _align_pd_first_step and batch.enable_overlap:
        for req in batch.reqs:
            setattr(req, _FIRST_STEP_ATTR, True)
    return result


def count_prompt_tail_first(original, batch, *args, **kwargs):
    """AROUND ScheduleBatch.cumulate_penalty_output_tokens: as SGLang's, except that a marked
    request (its first decode after a PD transfer) counts prompt[-1], as one server does.
    Every decode step of every role passes here: off the relay it is SGLang's call alone."""
    if not _align_pd_first_step:
        return original(batch, *args, **kwargs)
    marked = [getattr(req, _FIRST_STEP_ATTR, False) for req in batch.reqs]
    if not any(marked):
        return original(batch, *args, **kwargs)
    import torch

    last_tokens = []
    for req, first in zip(batch.reqs, marked):
        if first:
            setattr(req, _FIRST_STEP_ATTR, False)
            last_tokens.append(req.origin_input_ids[-1])
        else:
            last_tokens.append(req.output_ids[-1] if len(req.output_ids) else req.origin_input_ids[-1])
    ids = torch.tensor(last_tokens, dtype=torch.int64).to(batch.device, non_blocking=True)
    batch.sampling_info.penalizer_orchestrator.cumulate_output_tokens(ids)
    return None
