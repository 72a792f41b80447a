"""SGLang's penalty clock (sglang_glue/relay/penalty_clock.py): the pure history rule and the relay's
first-step hooks on a real ScheduleBatch-shaped object with a real penalizer (no server)."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest

from sglang_pdd.sglang_glue.relay import penalty_clock
from sglang_pdd.sglang_glue.relay.penalty_clock import history


def test_history_without_overlap_is_the_output():
    assert history([1, 2, 3], [7, 8, 9], overlap=False) == [7, 8, 9]
    assert history([1, 2, 3], [], overlap=False) == []


def test_history_under_overlap_is_one_token_late_and_starts_at_the_prompt_tail():
    assert history([1, 2, 3], [7], overlap=True) == [3]
    assert history([1, 2, 3], [7, 8, 9], overlap=True) == [3, 7, 8]
    assert history([1, 2, 3], [], overlap=True) == []


class _Orchestrator:
    def __init__(self):
        self.counted = []

    def cumulate_output_tokens(self, ids):
        self.counted.append(ids.tolist())


def _batch(reqs, overlap=True):
    return SimpleNamespace(reqs=reqs, enable_overlap=overlap, device="cpu",
                           sampling_info=SimpleNamespace(penalizer_orchestrator=_Orchestrator()))


def _req(prompt, output):
    return SimpleNamespace(origin_input_ids=array("q", prompt), output_ids=array("q", output))


def _sglang_cumulate(batch):
    """SGLang 0.5.23's cumulate_penalty_output_tokens, as the AROUND hook's original."""
    import torch

    last = [r.output_ids[-1] if len(r.output_ids) else r.origin_input_ids[-1] for r in batch.reqs]
    batch.sampling_info.penalizer_orchestrator.cumulate_output_tokens(torch.tensor(last))


@pytest.fixture
def aligned(monkeypatch):
    monkeypatch.setattr(penalty_clock, "_align_pd_first_step", True)


def test_relay_first_decode_counts_the_prompt_tail_then_follows_sglang(aligned):
    pytest.importorskip("torch")
    transferred, local = _req([5, 6], [40]), _req([1, 2], [30, 31])
    batch = _batch([transferred, local])
    penalty_clock.mark_transferred_requests(None, _batch([transferred]))
    # first decode after the PD transfer: prompt[-1] for the transferred request (one server's
    # first decode sees no output yet), SGLang's rule for the others
    penalty_clock.count_prompt_tail_first(_sglang_cumulate, batch)
    # overlap: the first decode's token is not processed yet; SGLang counts P's token now
    penalty_clock.count_prompt_tail_first(_sglang_cumulate, batch)
    assert batch.sampling_info.penalizer_orchestrator.counted == [[6, 31], [40, 31]]


def test_inert_without_overlap_or_off_the_relay(monkeypatch):
    pytest.importorskip("torch")
    for aligned, overlap in ((False, True), (True, False)):
        monkeypatch.setattr(penalty_clock, "_align_pd_first_step", aligned)
        req = _req([5, 6], [40])
        batch = _batch([req], overlap=overlap)
        penalty_clock.mark_transferred_requests(None, batch)
        penalty_clock.count_prompt_tail_first(_sglang_cumulate, batch)
        assert batch.sampling_info.penalizer_orchestrator.counted == [[40]]  # SGLang's own rule


def test_hook_targets_exist_in_this_sglang():
    """The hooks are registered by dotted path; a rename upstream must fail here, not silently."""
    from tests.conftest import require_sglang_import

    require_sglang_import()
    from sglang.srt.disaggregation.decode_schedule_batch_mixin import ScheduleBatchDisaggregationDecodeMixin
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    assert callable(ScheduleBatchDisaggregationDecodeMixin.process_prebuilt)
    assert callable(ScheduleBatch.cumulate_penalty_output_tokens)
    assert issubclass(ScheduleBatch, ScheduleBatchDisaggregationDecodeMixin)
