"""Unit tests of the resume marker (sglang_glue/md/resume.py): pure rules, the hooks on real SGLang
Req / penalizer objects (no server), and MD's handoff body."""

from __future__ import annotations

import weakref
from array import array
from types import SimpleNamespace

import pytest

from sglang_pdd.protocol import HandoffRequest
from sglang_pdd.sglang_glue.md.resume import (RESUME_KEY, ResumeError, handoff_generate_body, resume_output_len,
                                           split_resumed, validate_resume)
from tests.conftest import require_sglang_import


# ---- pure rules ----------------------------------------------------------------------------------

def test_marker_absent_or_malformed():
    assert resume_output_len(None) is None
    assert resume_output_len({}) is None
    assert resume_output_len({"other": 1}) is None
    assert resume_output_len({RESUME_KEY: 4}) == 4
    for bad in ("4", 4.0, True, None):
        with pytest.raises(ResumeError, match=RESUME_KEY):
            resume_output_len({RESUME_KEY: bad})


@pytest.mark.parametrize("k,n,max_new", [(0, 5, 10), (-1, 5, 10), (5, 5, 10), (6, 5, 10), (3, 5, 3), (4, 8, 2)])
def test_validate_refuses(k, n, max_new):
    with pytest.raises(ResumeError, match=RESUME_KEY):
        validate_resume(k, n, max_new)


def test_validate_accepts_and_split():
    validate_resume(1, 2, 2)
    validate_resume(4, 5, None)
    prompt, out = split_resumed([7, 8, 9, 10, 11], 2)
    assert (list(prompt), list(out)) == ([7, 8, 9], [10, 11])
    assert prompt.typecode == out.typecode == "q"


# ---- hooks on real SGLang objects ----------------------------------------------------------------

@pytest.fixture
def sglang_ctx():
    require_sglang_import()
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0):
        yield


def _req(ids, k=None, max_new=16, req_kwargs=None, **sampling):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    custom = {RESUME_KEY: k} if k is not None else None
    return Req("rid", "", array("q", ids), SamplingParams(max_new_tokens=max_new, custom_params=custom, **sampling),
               **(req_kwargs or {}))


def _scheduler(mode="null", overlap=False):
    return SimpleNamespace(disaggregation_mode=SimpleNamespace(value=mode), enable_overlap=overlap)


def _recv():
    return SimpleNamespace(input_embeds=None)


def test_seed_moves_the_tail_to_output(sglang_ctx):
    from sglang_pdd.sglang_glue.md.resume import resumed_len, seed_resumed_output

    req = seed_resumed_output(_req([1, 2, 3, 4, 5, 6], k=2), _scheduler(), _recv())
    assert list(req.origin_input_ids) == [1, 2, 3, 4]
    assert list(req.origin_input_ids_unpadded) == [1, 2, 3, 4]
    assert list(req.output_ids) == [5, 6]
    assert resumed_len(req) == 2 and req.to_finish is None
    req.refresh_fill_ids()  # SGLang's own view: the extend covers prompt + resumed output
    assert list(req.full_untruncated_fill_ids) == [1, 2, 3, 4, 5, 6]


def test_seed_pads_logprobs_of_the_resumed_positions(sglang_ctx):
    from sglang_pdd.sglang_glue.md.resume import seed_resumed_output

    req = seed_resumed_output(_req([1, 2, 3, 4, 5], k=2, req_kwargs={
        "return_logprob": True, "top_logprobs_num": 2, "token_ids_logprob": [4]}), _scheduler(), _recv())
    lp = req.logprob
    assert (lp.output_token_logprobs_val, lp.output_token_logprobs_idx) == ([None, None], [4, 5])
    assert lp.output_top_logprobs_val == lp.output_top_logprobs_idx == [None, None]
    assert lp.output_token_ids_logprobs_val == lp.output_token_ids_logprobs_idx == [None, None]
    plain = seed_resumed_output(_req([1, 2, 3, 4, 5], k=2, req_kwargs={"return_logprob": True}), _scheduler(), _recv())
    assert plain.logprob.output_top_logprobs_val == [] and plain.logprob.output_token_ids_logprobs_val == []


def test_seed_leaves_unmarked_requests_alone(sglang_ctx):
    from sglang_pdd.sglang_glue.md.resume import seed_resumed_output

    req = seed_resumed_output(_req([1, 2, 3]), _scheduler(), _recv())
    assert list(req.origin_input_ids) == [1, 2, 3] and list(req.output_ids) == []


def test_seed_leaves_sglangs_parallel_sampling_prefix_request_alone(sglang_ctx):
    from sglang_pdd.sglang_glue.md.resume import seed_resumed_output

    req = seed_resumed_output(_req([1, 2, 3], k=1, max_new=0), _scheduler(), _recv())
    assert list(req.origin_input_ids) == [1, 2, 3] and req.to_finish is None


@pytest.mark.parametrize("k,max_new,mode", [(3, 16, "null"), (2, 2, "null"), (1, 16, "prefill"), (1, 16, "decode")])
def test_seed_aborts_bad_markers_with_400(sglang_ctx, k, max_new, mode):
    from sglang_pdd.sglang_glue.md.resume import seed_resumed_output

    req = seed_resumed_output(_req([1, 2, 3], k=k, max_new=max_new), _scheduler(mode), _recv())
    assert req.to_finish is not None and req.to_finish.status_code == 400
    assert RESUME_KEY in req.to_finish.message
    assert list(req.output_ids) == []


class _Grammar:
    """Accepts tokens < 100 (SGLang's grammar objects raise ValueError on a rejected token)."""

    def __init__(self):
        self.accepted = []

    def accept_token(self, token):
        if token >= 100:
            raise ValueError(f"Tokens not accepted: {token}\nmore")
        self.accepted.append(token)


def test_grammar_advances_once_through_the_resumed_tokens(sglang_ctx):
    from sglang_pdd.sglang_glue.md.resume import advance_resumed_request, seed_resumed_output

    req = seed_resumed_output(_req([1, 2, 3, 4, 5], k=3), _scheduler(), _recv())
    req.grammar, req.logprob_start_len = _Grammar(), 2
    assert advance_resumed_request(None, req) is None
    assert req.grammar.accepted == [3, 4, 5]
    assert req.logprob_start_len == -1  # no input logprobs on a resumed request
    advance_resumed_request(None, req, is_retracted=True)  # a retracted request re-enters the queue
    assert req.grammar.accepted == [3, 4, 5]


def test_grammar_rejecting_a_resumed_token_aborts_with_400(sglang_ctx):
    from sglang_pdd.sglang_glue.md.resume import advance_resumed_request, seed_resumed_output

    req = seed_resumed_output(_req([1, 2, 3, 150, 5], k=3), _scheduler(), _recv())
    req.grammar = _Grammar()
    advance_resumed_request(None, req)
    assert req.to_finish.status_code == 400
    assert "token 150 at position 1" in req.to_finish.message and "grammar" in req.to_finish.message
    assert list(req.output_ids) == []


# Penalizers: seeding at _prepare must equal what the server counts when it samples the resumed
# tokens itself, one cumulation per step on its clock (relay/penalty_clock.py): without overlap
# out[0..k-1]; under overlap (one token late) prompt[-1], out[0..k-2].

class _Orchestrator:
    def __init__(self, reqs, vocab_size=12):
        self._reqs, self.vocab_size, self.device = reqs, vocab_size, "cpu"

    def reqs(self):
        return self._reqs


def _penalizer_state(cls_name, seed_fn, reqs, sequential: bool, overlap: bool = False):
    import torch
    from sglang.srt.sampling import penaltylib

    cls = getattr(penaltylib, cls_name)
    orch = _Orchestrator(reqs)
    pen = cls(orch)
    pen._orchestrator_ref = weakref.ref(orch)
    pen._prepare()
    if sequential:  # what SGLang does when the tokens are sampled: one cumulation per step
        for pos in range(max(len(r.output_ids) for r in reqs)):
            last = [(r.output_ids[pos - 1] if pos else r.origin_input_ids[-1]) if overlap else r.output_ids[pos]
                    for r in reqs]
            pen._cumulate_output_tokens(torch.tensor(last, dtype=torch.int64))
    else:
        seed_fn(None, pen)
    return {name: value.clone() for name, value in vars(pen).items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
@pytest.mark.parametrize("cls_name,sampling", [
    ("BatchedFrequencyPenalizer", {"frequency_penalty": 0.7}),
    ("BatchedPresencePenalizer", {"presence_penalty": 0.4}),
    ("BatchedRepetitionPenalizer", {"repetition_penalty": 1.3}),
    ("BatchedMinNewTokensPenalizer", {"min_new_tokens": 9, "stop_token_ids": [11]}),
])
def test_penalizer_seed_equals_sampling_the_tokens(sglang_ctx, cls_name, sampling, overlap):
    import torch

    from sglang_pdd.sglang_glue.md.resume import PENALIZER_SEEDS, seed_resumed_output

    seed_fn = next(fn for target, fn in PENALIZER_SEEDS.items() if target.split(".")[-2] == cls_name)
    tokenizer = SimpleNamespace(additional_stop_token_ids=None, eos_token_id=None)

    def reqs():
        out = []
        for ids in ([1, 2, 3, 4, 4, 7, 4], [5, 6, 7, 8, 9, 8, 8]):
            req = seed_resumed_output(_req(ids, k=4, **sampling), _scheduler(overlap=overlap), _recv())
            req.tokenizer = tokenizer
            out.append(req)
        return out

    seeded = _penalizer_state(cls_name, seed_fn, reqs(), sequential=False)
    sampled = _penalizer_state(cls_name, seed_fn, reqs(), sequential=True, overlap=overlap)
    other_clock = _penalizer_state(cls_name, seed_fn, reqs(), sequential=True, overlap=not overlap)
    if cls_name != "BatchedMinNewTokensPenalizer":  # a count: the same on both clocks
        assert any(not torch.equal(seeded[n], other_clock[n]) for n in seeded), "the clock changed nothing"
    assert seeded.keys() == sampled.keys()
    for name in seeded:
        assert torch.equal(seeded[name], sampled[name]), name
    fresh = _penalizer_state(cls_name, lambda *a: None, reqs(), sequential=False)
    assert any(not torch.equal(seeded[n], fresh[n]) for n in seeded), "seeding changed nothing"


# ---- MD's handoff body ---------------------------------------------------------------------------

def test_handoff_marks_the_eager_tokens_and_keeps_the_total_budget():
    body = {"token_ids": [7, 8], "rid": "r-m", "stream": True,
            "sampling_params": {"max_new_tokens": 20, "stop": ["x"], "custom_params": {"pdd_evil": 1, "mine": 2}},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": -1, "token_ids_logprob": None}
    gen, stream = handoff_generate_body([1, 2, 3], HandoffRequest.from_json(body))
    assert stream is True
    assert gen == {"input_ids": [1, 2, 3, 7, 8], "rid": "r-m", "stream": True,
                   "sampling_params": {"max_new_tokens": 20, "stop": ["x"],
                                       "custom_params": {"mine": 2, RESUME_KEY: 2}},
                   "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": -1}


def test_handoff_without_eager_tokens_is_a_plain_request():
    gen, stream = handoff_generate_body([1, 2], HandoffRequest([], sampling_params={"max_new_tokens": 5}, stream=False))
    assert not stream
    assert gen == {"input_ids": [1, 2], "rid": None, "stream": False, "sampling_params": {"max_new_tokens": 5}}


def test_handoff_warmup_only_extends():
    gen, stream = handoff_generate_body([1, 2], HandoffRequest(
        [7, 8, 9], warmup=True, stream=True, return_logprob=True, sampling_params={"max_new_tokens": 50}))
    assert not stream
    assert gen == {"input_ids": [1, 2, 7, 8, 9], "rid": None, "stream": False,
                   "sampling_params": {"max_new_tokens": 4, "custom_params": {RESUME_KEY: 3}}}


@pytest.mark.parametrize("body,field", [
    ({"sampling_params": []}, "sampling_params"),
    ({"sampling_params": {"custom_params": 3}}, "custom_params"),
    ({"sampling_params": {"max_new_tokens": 2}}, "max_new_tokens"),
    ({"sampling_params": {}, "stream": "yes"}, "stream"),
])
def test_handoff_refuses_bad_bodies_naming_the_field(body, field):
    """Refused by the message's own check (HandoffRequest.from_json) or by the body's."""
    with pytest.raises(ValueError, match=field):
        handoff_generate_body([1, 2], HandoffRequest.from_json({**body, "token_ids": [7, 8]}))
