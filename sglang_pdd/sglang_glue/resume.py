"""Resume a request: its last k input ids are output it has ALREADY produced (issue 10, item 2).

The router's handoff gives MD ``input_ids = prompt + eager`` where the eager tokens came from
RLD. Sent as a plain request, SGLang would treat them as prompt: the grammar would restart,
stop strings, penalties and min/max_new_tokens would ignore them, usage would count them as
prompt. The marker ``sampling_params.custom_params["pdd_resume_output_len"] = k`` (set only by
the router / MD glue; the router strips client ``pdd_*`` custom params) makes a server with
this plugin build the request as if it had generated those k tokens itself.

What the server does with it (plain server, i.e. MD; attached in plugin.py through HookRegistry,
no patch):
* ``Scheduler._create_generation_req`` (after): ``origin_input_ids = input_ids[:-k]``,
  ``output_ids = input_ids[-k:]`` — SGLang's retract path already re-prefills
  ``origin + output`` as one extend and continues decoding, so nothing else in the scheduler
  changes. ``init_req_max_new_tokens``, input-length checks and ``prompt_tokens`` then see the
  real prompt; ``max_new_tokens`` is the client's TOTAL budget (``len(output_ids)`` counts the
  k tokens), so is ``completion_tokens``.
* ``Scheduler._add_request_to_queue`` (before; both the direct and the grammar-queue path end
  there, once the grammar object is ready): the grammar (regex / json_schema / ebnf /
  structural_tag) accepts the k tokens; a token it rejects aborts the request with 400.
* each penalizer's ``_prepare`` (after): frequency / presence / repetition count the k tokens
  and min_new_tokens counts them, exactly as if they had been sampled.
* stop strings / stop regexes: SGLang checks the decoded tail of ``output_ids``, which now
  holds the k tokens, so a stop string straddling the cut is found at the first new token;
  stop token ids are checked per new token (the k tokens are known not to finish the request).
* The response / stream reports the WHOLE output from position 0: ``output_ids`` and ``text``
  start with the k tokens (the detokenizer's read offset is ``len(prompt)``), streaming is
  SGLang's cumulative stream, the first chunk carries k+1 tokens.

Logprobs (``return_logprob``) of a resumed request, precisely:
* ``meta_info.output_token_logprobs`` (and ``output_top_logprobs`` /
  ``output_token_ids_logprobs``) hold the positions the server generated, i.e. output
  positions k .. N-1 (N = completion_tokens), in order; entry j is position k+j and its token
  id equals ``output_ids[k+j]``. Positions 0 .. k-1 are NOT returned: the router splices them
  from RLD's stream.
* ``meta_info.input_token_logprobs`` / ``input_top_logprobs`` are always ``[]`` (the client's
  ``logprob_start_len`` is ignored): the request's prefill was done by P, whose stream the
  router already has. SGLang would otherwise score the resumed tokens as prompt (against
  padded ids) and trip its input-logprob length check.

Guards (400 naming ``pdd_resume_output_len``): k must be an int with 0 < k < len(input_ids),
below max_new_tokens; not combined with input_embeds.

The caller must not resume a request whose resumed tokens already finish it (a stop token,
a complete stop string, the length budget): the server checks stops from the first new token
on, as a single server would have done one step earlier.

PD mode (P prefill + RLD decode, the router's recovery legs): NOT supported; a PD server
answers 400. SGLang's PD path owns the request's output on both sides: P's prefill queue
resets ``output_ids`` (``disaggregation/prefill.py`` requeue) and sends only the first sampled
token, RLD's decode side builds its own Req from origin_input_ids and takes its first output
token from P's metadata buffer (``decode.py`` / ``decode_schedule_batch_mixin``), and the KV
P sends covers ``origin_input_ids`` only. Resuming there needs a seam in both transfer
paths (P: send KV for prompt+k; RLD: seed output_ids before the first token) — not a hook.
"""

from __future__ import annotations

import logging
from array import array
from http import HTTPStatus
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

RESUME_KEY = "pdd_resume_output_len"
_RESUMED_ATTR = "_pdd_resumed_len"  # set on a Req: how many of its output_ids were resumed
_GRAMMAR_PENDING_ATTR = "_pdd_resume_grammar_pending"


class ResumeError(ValueError):
    """A resume marker that cannot be honoured; the message names the field."""


def resume_output_len(custom_params: Any) -> Optional[int]:
    """The marker's k, or None when the request carries none. Raises ResumeError if malformed."""
    if not isinstance(custom_params, dict) or RESUME_KEY not in custom_params:
        return None
    k = custom_params[RESUME_KEY]
    if isinstance(k, bool) or not isinstance(k, int):
        raise ResumeError(f"custom_params.{RESUME_KEY} must be an int, got {k!r}")
    return k


def validate_resume(k: int, n_input_ids: int, max_new_tokens: Optional[int]) -> None:
    """0 < k < len(input_ids) (a prompt must remain) and k < max_new_tokens (else it is done)."""
    if not 0 < k < n_input_ids:
        raise ResumeError(f"custom_params.{RESUME_KEY}={k} must be in 1..{n_input_ids - 1} "
                          f"(input_ids holds {n_input_ids} tokens, the prompt needs at least one)")
    if max_new_tokens is not None and k >= max_new_tokens:
        raise ResumeError(f"custom_params.{RESUME_KEY}={k} must be below sampling_params.max_new_tokens="
                          f"{max_new_tokens} (the total output budget)")


def split_resumed(input_ids: Sequence[int], k: int) -> tuple[array, array]:
    """(prompt ids, resumed output ids) as SGLang's int64 arrays."""
    ids = array("q", input_ids)
    return ids[:-k], ids[-k:]


def resumed_len(req) -> int:
    return getattr(req, _RESUMED_ATTR, 0)


# ---- hooks (HookRegistry; registered in plugin.py) -------------------------------------------

def seed_resumed_output(req, scheduler, recv_req, *args, **kwargs):
    """AFTER Scheduler._create_generation_req: move the resumed tail from prompt to output."""
    try:
        k = resume_output_len(getattr(req.sampling_params, "custom_params", None))
        if k is None:
            return req
        if getattr(recv_req, "input_embeds", None) is not None:
            raise ResumeError(f"custom_params.{RESUME_KEY} needs input_ids, not input_embeds")
        if scheduler.disaggregation_mode.value != "null":
            raise ResumeError(f"custom_params.{RESUME_KEY} is not supported on a PD "
                              f"{scheduler.disaggregation_mode.value} server (see sglang_glue/resume.py)")
        validate_resume(k, len(req.origin_input_ids), req.sampling_params.max_new_tokens)
    except ResumeError as e:
        req.set_finish_with_abort(str(e), status_code=HTTPStatus.BAD_REQUEST)
        return req
    prompt, resumed = split_resumed(req.origin_input_ids, k)
    unpadded_is_origin = req.origin_input_ids_unpadded is req.origin_input_ids
    req.origin_input_ids = prompt
    if unpadded_is_origin:
        req.origin_input_ids_unpadded = prompt
    req.output_ids = resumed
    setattr(req, _RESUMED_ATTR, k)
    setattr(req, _GRAMMAR_PENDING_ATTR, True)
    return req


def advance_resumed_request(scheduler, req, *args, **kwargs):
    """BEFORE Scheduler._add_request_to_queue: the grammar is ready here; feed it the k tokens.

    Also drop input logprobs (see the module docstring). Runs once per request (a retracted
    request re-enters with its grammar already advanced)."""
    if not getattr(req, _GRAMMAR_PENDING_ATTR, False):
        return None
    setattr(req, _GRAMMAR_PENDING_ATTR, False)
    if req.finished() or req.to_finish is not None:
        return None
    req.logprob_start_len = -1
    grammar = getattr(req, "grammar", None)
    if grammar is None or not hasattr(grammar, "accept_token"):
        return None
    for pos, token in enumerate(req.output_ids):
        try:
            grammar.accept_token(int(token))
        except ValueError as e:
            req.set_finish_with_abort(
                f"custom_params.{RESUME_KEY}: resumed output token {int(token)} at position {pos} "
                f"does not match the request's grammar ({str(e).splitlines()[0]})",
                status_code=HTTPStatus.BAD_REQUEST)
            req.output_ids = array("q")
            return None
    return None


def _resumed_rows(penalizer):
    """(row index, resumed req) for the orchestrator's requests that carry resumed output."""
    return [(i, req) for i, req in enumerate(penalizer.orchestrator.reqs())
            if resumed_len(req) and len(req.output_ids)]


def _ids_tensor(req, device):
    import torch

    return torch.tensor(list(req.output_ids), dtype=torch.int64, device=device)


def seed_frequency_penalty(result, penalizer, *args, **kwargs):
    """AFTER BatchedFrequencyPenalizer._prepare: each resumed token adds its penalty once."""
    for i, req in _resumed_rows(penalizer):
        ids = _ids_tensor(req, penalizer.cumulated_frequency_penalties.device)
        row = penalizer.cumulated_frequency_penalties[i]
        row.scatter_add_(0, ids, penalizer.frequency_penalties[i].expand(ids.shape[0]))
    return result


def seed_presence_penalty(result, penalizer, *args, **kwargs):
    """AFTER BatchedPresencePenalizer._prepare: every token present in the output is penalized."""
    for i, req in _resumed_rows(penalizer):
        ids = _ids_tensor(req, penalizer.cumulated_presence_penalties.device)
        penalizer.cumulated_presence_penalties[i, ids] = penalizer.presence_penalties[i, 0]
    return result


def seed_repetition_penalty(result, penalizer, *args, **kwargs):
    """AFTER BatchedRepetitionPenalizer._prepare: every token present in the output is scaled."""
    for i, req in _resumed_rows(penalizer):
        ids = _ids_tensor(req, penalizer.cumulated_repetition_penalties.device)
        penalizer.cumulated_repetition_penalties[i, ids] = penalizer.repetition_penalties[i, 0]
    return result


def seed_min_new_tokens(result, penalizer, *args, **kwargs):
    """AFTER BatchedMinNewTokensPenalizer._prepare: the resumed tokens count toward the minimum."""
    for i, req in _resumed_rows(penalizer):
        penalizer.len_output_tokens[i, 0] = len(req.output_ids)
    return result


_PENALTYLIB = "sglang.srt.sampling.penaltylib"
PENALIZER_SEEDS = {
    f"{_PENALTYLIB}.frequency_penalty.BatchedFrequencyPenalizer._prepare": seed_frequency_penalty,
    f"{_PENALTYLIB}.presence_penalty.BatchedPresencePenalizer._prepare": seed_presence_penalty,
    f"{_PENALTYLIB}.repetition_penalty.BatchedRepetitionPenalizer._prepare": seed_repetition_penalty,
    f"{_PENALTYLIB}.min_new_tokens.BatchedMinNewTokensPenalizer._prepare": seed_min_new_tokens,
}
