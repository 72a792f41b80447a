"""Resume a request: its last k input ids are output it has ALREADY produced.

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
* each penalizer's ``_prepare`` (after): frequency / presence / repetition hold what the server
  would have counted had it sampled the k tokens itself (its penalty clock, one token late under
  the overlap scheduler: relay/penalty_clock.py), and min_new_tokens counts them.
* stop strings / stop regexes: SGLang checks the decoded tail of ``output_ids``, which now
  holds the k tokens, so a stop string straddling the cut is found at the first new token;
  stop token ids are checked per new token (the k tokens are known not to finish the request).
* The response / stream reports the WHOLE output from position 0: ``output_ids`` and ``text``
  start with the k tokens (the detokenizer's read offset is ``len(prompt)``), streaming is
  SGLang's cumulative stream, the first chunk carries k+1 tokens.

Logprobs (``return_logprob``) of a resumed request, precisely:
* ``meta_info.output_token_logprobs`` has one entry per output position 0 .. N-1
  (N = completion_tokens), aligned with ``output_ids`` as on a single server. Entries
  k .. N-1 are the server's own ``[logprob, token_id, text]``. Entries 0 .. k-1 are
  placeholders ``[None, resumed token id, text]``: the server did not sample them, the router
  splices RLD's values in. Likewise ``output_top_logprobs`` / ``output_token_ids_logprobs``
  (when asked for): entries 0 .. k-1 are ``None``, entries k .. N-1 the server's. The
  placeholders are what keeps SGLang's streamer aligned (it sends logprobs by output_ids
  offsets), so a stream's cumulative logprobs also cover positions 0 .. N-1.
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
answers 400 naming the field, so a caller must not send the marker there. Why no hook does it:
SGLang's PD path ties both the KV hand-over and the first token to ``origin_input_ids``.
P sends KV only for ``len(origin_input_ids)`` tokens (``PrefillBootstrapQueue``'s
``_send_kv_chunk``: ``transfer_input_len``) and puts ``output_ids[0]`` in the metadata buffer
as the first token (``MetadataBuffers.set_buf``) — with resumed output that is the first
RESUMED token, not the one P sampled; RLD preallocates ``origin + max(len(output_ids)-1, 0)``
slots (``DecodePreallocQueue._pre_alloc_fill_len``) and appends P's token. Supporting it
means P sending ``prompt + k`` tokens of KV and its last output id, and RLD preallocating
``prompt + k`` — SGLang's PD-retract rebootstrap (``pd_rebootstrap_in_progress``) does exactly
this for its own requests, so the upstreamable change is to let a resumed request take that
path; it touches prefill.py, decode.py and utils.py (and our pdd sender's page range), too
much to land and test here. Until then a recovery leg (P -> RLD with prompt + emitted)
restarts the request from the emitted tokens as prompt, as before.
"""

from __future__ import annotations

import logging
from array import array
from http import HTTPStatus
from typing import Any, Optional, Sequence

from sglang_pdd.protocol import HANDOFF_LOGPROB_FIELDS, RESUME_KEY, HandoffRequest, without_pdd_params
from sglang_pdd.sglang_glue.relay import penalty_clock
logger = logging.getLogger(__name__)

_RESUMED_ATTR = "_pdd_resumed_len"  # set on a Req: how many of its output_ids were resumed
_GRAMMAR_PENDING_ATTR = "_pdd_resume_grammar_pending"
_OVERLAP_ATTR = "_pdd_resume_overlap"  # on a Req: the server's scheduler overlaps (penalty clock)


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
        if k is None or req.sampling_params.max_new_tokens == 0:
            # max_new_tokens 0: SGLang's own prefix-caching request ahead of n > 1 samples
            # (copied sampling params); caching prompt + resumed tokens is what it should do.
            return req
        if getattr(recv_req, "input_embeds", None) is not None:
            raise ResumeError(f"custom_params.{RESUME_KEY} needs input_ids, not input_embeds")
        if scheduler.disaggregation_mode.value != "null":
            raise ResumeError(f"custom_params.{RESUME_KEY} is not supported on a PD "
                              f"{scheduler.disaggregation_mode.value} server (see sglang_glue/md/resume.py)")
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
    if req.return_logprob:
        _pad_resumed_logprobs(req.logprob, resumed)
    setattr(req, _RESUMED_ATTR, k)
    setattr(req, _GRAMMAR_PENDING_ATTR, True)
    setattr(req, _OVERLAP_ATTR, bool(getattr(scheduler, "enable_overlap", False)))
    return req


def _pad_resumed_logprobs(logprob, resumed: array) -> None:
    """Placeholders for the k positions the server did not sample (see the module docstring)."""
    k = len(resumed)
    logprob.output_token_logprobs_val.extend([None] * k)
    logprob.output_token_logprobs_idx.extend(int(t) for t in resumed)
    if logprob.top_logprobs_num > 0:
        logprob.output_top_logprobs_val.extend([None] * k)
        logprob.output_top_logprobs_idx.extend([None] * k)
    if logprob.token_ids_logprob is not None:
        logprob.output_token_ids_logprobs_val.extend([None] * k)
        logprob.output_token_ids_logprobs_idx.extend([None] * k)


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
    """The tokens the server's penalizers would hold now (penalty_clock.history)."""
    import torch

    counted = penalty_clock.history(req.origin_input_ids, req.output_ids, getattr(req, _OVERLAP_ATTR, False))
    return torch.tensor(counted, dtype=torch.int64, device=device)


def seed_frequency_penalty(result, penalizer, *args, **kwargs):
    """AFTER BatchedFrequencyPenalizer._prepare: each counted token adds its penalty once."""
    for i, req in _resumed_rows(penalizer):
        ids = _ids_tensor(req, penalizer.cumulated_frequency_penalties.device)
        row = penalizer.cumulated_frequency_penalties[i]
        row.scatter_add_(0, ids, penalizer.frequency_penalties[i].expand(ids.shape[0]))
    return result


def seed_presence_penalty(result, penalizer, *args, **kwargs):
    """AFTER BatchedPresencePenalizer._prepare: every counted token is penalized."""
    for i, req in _resumed_rows(penalizer):
        ids = _ids_tensor(req, penalizer.cumulated_presence_penalties.device)
        penalizer.cumulated_presence_penalties[i, ids] = penalizer.presence_penalties[i, 0]
    return result


def seed_repetition_penalty(result, penalizer, *args, **kwargs):
    """AFTER BatchedRepetitionPenalizer._prepare: every counted token is scaled."""
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


# ---- MD's handoff: the router's compact body -> MD's own /generate -----------------------------



def handoff_generate_body(prompt_ids: Sequence[int], req: HandoffRequest) -> tuple[dict, bool]:
    """MD's /generate for a handoff (see the resume contract); returns (generate body, stream?).

    input_ids = registered prompt + the handoff's eager ``token_ids``, marked so the eager
    tokens are output already produced; sampling_params are the client's (max_new_tokens is
    the TOTAL budget). A warmup (catch-up batch) only extends: one token beyond the eager ones,
    not streamed, no logprobs, and its output is discarded by the caller. Raises ValueError
    naming the field."""
    eager = req.token_ids
    custom = req.sampling_params.get("custom_params")
    custom = {} if custom is None else custom
    if not isinstance(custom, dict):
        raise ValueError("sampling_params.custom_params must be an object")
    custom = without_pdd_params(custom)
    k = len(eager)
    if k:
        custom[RESUME_KEY] = k
    sampling = {**req.sampling_params, "custom_params": custom} if custom else \
        {key: value for key, value in req.sampling_params.items() if key != "custom_params"}
    gen = {"input_ids": list(prompt_ids) + list(eager), "rid": req.rid}
    if req.warmup:
        gen.update(sampling_params={**sampling, "max_new_tokens": k + 1}, stream=False)
        return gen, False
    max_new = sampling.get("max_new_tokens")
    if k and isinstance(max_new, int) and not isinstance(max_new, bool) and k >= max_new:
        raise ValueError(f"token_ids holds {k} eager tokens, at least sampling_params.max_new_tokens={max_new}: "
                         "nothing is left for MD to generate")
    gen.update(sampling_params=sampling, stream=req.stream)
    gen.update({field: getattr(req, field) for field in HANDOFF_LOGPROB_FIELDS if getattr(req, field) is not None})
    return gen, req.stream
