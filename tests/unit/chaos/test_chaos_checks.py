"""The chaos run's checks (pure): streams, statuses, leaks, the router's metrics, the row."""

import re

import pytest

from sglang_pdd.chaos.checks import (EVIDENCE, FAULT_GRACE_S, HANDOFF_SLACK_S, RECOVERY_SLACK_S, SLOW_HANDOFF, SLOW_KV,
                                     STATUSES, CounterLedger, FiredFault, GapBounds, RequestRecord, Slower,
                                     StreamTracker, cells, counted, counters, evaluate, explained, gap_bound, gap_kind,
                                     leaks, table, token_errors)
from sglang_pdd.chaos.spec import ALL_KINDS, FaultKind
from tests.conftest import REPO_ROOT

DOCS = REPO_ROOT / "docs"
REF = [11, 12, 13, 14, 15, 16]


# ------------------------------------------------------------------------------ streams
def stream(*events):
    t = StreamTracker()
    for e in events:
        t.feed(list(e))
    return t


def test_a_cumulative_stream_prints_each_token_once():
    t = stream([11], [11, 12, 13], [11, 12, 13], [11, 12, 13, 14, 15, 16])
    assert t.received == REF and t.breaks == 0 and t.events == 4
    assert token_errors(t.received, REF, completed=True) == (0, 0)


def test_a_stream_that_starts_over_is_a_break_and_its_repeated_tokens_duplicates():
    # e.g. a retry elsewhere that sent the output again from the start in one event
    t = stream([11, 12, 13], [11, 12, 13, 14], [11, 12, 13, 14, 15, 16, 11, 12])
    assert t.breaks == 0  # the last event extends the one before: only the tail is new
    t2 = stream([11, 12, 13], [99], [99, 12])
    assert t2.breaks == 1
    assert t2.received == [11, 12, 13, 12]  # what a client printing the new parts printed


@pytest.mark.parametrize("received, completed, dup, skip", [
    ([11, 12, 13, 13, 14, 15, 16], True, 1, 0),  # a token printed twice
    ([11, 12, 13, 14, 15, 16, 15, 16], True, 2, 0),  # a resumed stream repeating its tail
    ([11, 12, 14, 15, 16], True, 0, 1),  # a token lost at a handoff
    ([11, 12, 99, 14, 15, 16], True, 1, 1),  # a changed token: one extra, one missing
    ([11, 12, 13], False, 0, 0),  # a failed stream that stopped early skipped nothing it reached
    ([11, 13], False, 0, 1),  # ... but a hole before where it got is a skip
    ([], True, 0, 6),  # "completed" with nothing: every token skipped
    ([], False, 0, 0),
])
def test_duplicated_and_skipped_tokens_against_the_reference(received, completed, dup, skip):
    assert token_errors(received, REF, completed) == (dup, skip)


def test_the_longest_gap_is_between_events_that_print_and_not_the_time_to_first_token():
    t = StreamTracker()
    t.feed([], at=100.0)  # an event with nothing new (e.g. meta only): no token, no gap yet
    t.feed([11], at=105.0)  # the first token 5 s in: a time to first token, not a gap
    t.feed([11, 12], at=105.5)
    t.feed([11, 12], at=107.0)  # bytes without a token do not end a gap
    t.feed([11, 12, 13, 14], at=109.5)  # 4 s after token 2
    t.feed([11, 12, 13, 14, 15], at=110.0)
    assert t.longest_gap_s == pytest.approx(4.0) and t.gap_began_s == 105.5 and t.gap_after == 2
    untimed = stream([11], [11, 12])
    assert untimed.longest_gap_s == 0.0 and untimed.gap_began_s is None


# ------------------------------------------------------------------------------ gaps
def gapped(gap, after, path="p_rld_md", handoff_at=None, wan_ready_s=None, index=0):
    return RequestRecord(index, "k", 0.0, 30.0, "200", tuple(REF), path=path, longest_gap_s=gap, gap_began_s=12.0,
                         gap_after=after, handoff_at=handoff_at, wan_ready_s=wan_ready_s)


def test_a_gap_is_sorted_by_where_it_lies_and_bounded_by_the_deadline_that_governs_there():
    bounds = GapBounds(first_token_s=3.0, stall_s=20.0, wan_timeout_s=6.0)
    # waiting for MD's first token at the cut (MD took over at 5, or never did): its own deadline
    for r in (gapped(4.0, 5, handoff_at=5), gapped(4.0, 5), gapped(0.5, 2, path="p_rld_only")):
        assert gap_kind(r) == "handoff" and gap_bound(r, bounds) == 3.0 + HANDOFF_SLACK_S
    # inside MD's committed stream (or the recovery after it): the stall timeout
    r = gapped(7.0, 9, handoff_at=5)
    assert gap_kind(r) == "md_stream" and gap_bound(r, bounds) == 20.0 + RECOVERY_SLACK_S
    # after RLD's one bridging token on P->MD: the wait for MD's KV, then the handoff's
    r = gapped(4.0, 1, path="p_md", handoff_at=1, wan_ready_s=0.8)
    assert gap_kind(r) == "p_md_bridge" and gap_bound(r, bounds) == pytest.approx(0.8 + 3.0 + HANDOFF_SLACK_S)
    assert gap_bound(gapped(4.0, 1, path="p_md"), bounds) == 6.0 + 3.0 + HANDOFF_SLACK_S  # KV never landed
    # without the first-token deadline the stall timeout bounds the wait at the cut too
    assert gap_bound(gapped(4.0, 5), GapBounds(first_token_s=0.0, stall_s=20.0)) == 20.0 + HANDOFF_SLACK_S


def test_a_client_waiting_past_the_bound_fails_a_row_that_bounds_gaps():
    refs = {"k": REF}
    records = [gapped(1.0, 3, index=0), gapped(9.0, 5, handoff_at=5, index=1), gapped(12.0, 8, handoff_at=5, index=2)]
    bounds = GapBounds(first_token_s=3.0, stall_s=20.0)
    row = evaluate("wan_blip", records, refs, [], gap_bounds=bounds)
    assert row.gaps == {"handoff": 9.0, "md_stream": 12.0}
    assert not row.passed and len(row.over_bound) == 1 and row.over_bound[0].startswith("#1 k waited 9.0s")
    assert "waited past the bound" in cells(row)[-1]
    assert evaluate("wan_down", records, refs, []).passed  # a scenario that does not bound them reports them only
    assert evaluate("wan_blip", records, refs, [], gap_bounds=GapBounds(first_token_s=0.0, stall_s=20.0)).passed


# ------------------------------------------------------------------------------ statuses
def rec(status, sent=10.0, ended=12.0, retry_after=None, received=(), key="k", index=0, breaks=0, path="p_md"):
    return RequestRecord(index, key, sent, ended, status, tuple(received), breaks, retry_after=retry_after, path=path)


KILL_P = FiredFault(FaultKind.KILL_P, started_s=10.0, recovered_s=20.0)


def test_503_is_documented_only_with_retry_after_and_while_no_p_or_rld_can_serve():
    assert explained(rec("503", retry_after="1"), [KILL_P])
    assert not explained(rec("503"), [KILL_P])  # without Retry-After: not what the docs promise
    assert not explained(rec("503", retry_after="1"), [])  # no fault: nothing explains it
    wan = FiredFault(FaultKind.WAN_DOWN, 10.0, 20.0)
    assert not explained(rec("503", retry_after="1"), [wan])  # MD down never takes P or RLD away
    late = 20.0 + FAULT_GRACE_S + 0.1
    assert not explained(rec("503", sent=late, ended=late + 1, retry_after="1"), [KILL_P])  # long recovered
    assert not explained(rec("503", sent=1.0, ended=9.0, retry_after="1"), [KILL_P])  # before it fired
    assert explained(rec("503", sent=1.0, ended=10.5, retry_after="1"), [KILL_P])  # in flight when it fired


def test_a_shed_503_is_documented_at_any_time_with_retry_after():
    """The router's overload 503 (router/front/overload.py) comes with or without a fault."""
    import dataclasses

    shed = dataclasses.replace(rec("503", retry_after="1"), message='{"error": "overloaded: 64 requests in flight"}')
    assert explained(shed, []) and explained(shed, [FiredFault(FaultKind.KILL_MD, 10.0, 20.0)])
    assert not explained(dataclasses.replace(shed, retry_after=None), [])  # Retry-After still required


@pytest.mark.parametrize("status", ["cut", "timeout", "refused", "500", "stream_500", "bad_reply", "200x"])
def test_anything_not_documented_is_never_explained(status):
    every = [FiredFault(k, 0.0, 100.0) for k in ALL_KINDS]
    assert not explained(rec(status, retry_after="1"), every)


def test_the_documented_statuses_are_the_ones_docs_api_promises():
    api = (DOCS / "api.md").read_text()
    assert re.search(r"503 with\s+`Retry-After: 1`", api)
    assert "| a backend failure the flow cannot recover | 502 (streams: an error event, then `[DONE]`) |" in api
    for status in STATUSES:
        assert status.removeprefix("stream_") in api
    assert STATUSES["503"].retry_after and not STATUSES["502"].retry_after
    # an MD fault never fails a request: the request stays on RLD (docs/router.md's fallbacks)
    for doc in STATUSES.values():
        assert not {FaultKind.KILL_MD, FaultKind.WAN_DOWN, FaultKind.WAN_SLOW, FaultKind.MD_DRAIN,
                    FaultKind.MD_SLOW} & set(doc.during)


# ------------------------------------------------------------------------------ leaks
def test_leaks_name_every_server_and_counter_still_held():
    held = {"md": {"open_rooms": 0, "held_kv_slots": 2}, "prefill": {"num_running_reqs": 0, "staged_bytes": 4096},
            "relay": {"num_running_reqs": 0}}
    found = leaks(held, {"md": 200, "relay": 400}, ["md: memory leak detected! 12"])
    assert found == ["md: held_kv_slots = 2", "prefill: staged_bytes = 4096", "relay: /flush_cache answered 400",
                     "log: md: memory leak detected! 12"]
    assert leaks({"md": {"open_rooms": 0}}, {"md": 200}) == []


# ------------------------------------------------------------------------------ metrics
def key(name, **labels):
    return (name, frozenset(labels.items()))


def test_counters_keep_only_samples_that_only_go_up():
    samples = [("pdd:fallbacks_total", {"reason": "md_failed"}, 2.0), ("pdd:backend_up", {"role": "main"}, 1.0),
               ("pdd:ttft_seconds_count", {"path": "p_md"}, 5.0), ("pdd:ttft_seconds_sum", {"path": "p_md"}, 1.5),
               ("pdd:ttft_seconds_bucket", {"path": "p_md", "le": "1.0"}, 4.0)]
    assert counters(samples) == {key("pdd:fallbacks_total", reason="md_failed"): 2.0,
                                 key("pdd:ttft_seconds_count", path="p_md"): 5.0,
                                 key("pdd:ttft_seconds_bucket", path="p_md", le="1.0"): 4.0}


def kv_latency(count, within_1s):
    return {key("pdd:kv_transfer_latency_ms_count"): count,
            key("pdd:kv_transfer_latency_ms_bucket", le="1000.0"): within_1s,
            key("pdd:kv_transfer_latency_ms_bucket", le="2500.0"): count}


def test_a_slowed_wan_is_counted_by_kv_transfers_over_a_second_only():
    before = kv_latency(10, 10)
    assert SLOW_KV.total(before) == 0
    assert counted(FaultKind.WAN_SLOW, before, kv_latency(30, 28))  # two of the new twenty took > 1 s
    assert not counted(FaultKind.WAN_SLOW, before, kv_latency(30, 30))  # more transfers, none slow
    assert not counted(FaultKind.KILL_MD, before, kv_latency(30, 28))  # slowness is no kill
    stall = {key("pdd:handoff_stall_seconds_count", mode="one_shot"): 3.0,
             key("pdd:handoff_stall_seconds_bucket", mode="one_shot", le="0.5"): 3.0,
             key("pdd:handoff_stall_seconds_count", mode="catch_up"): 5.0,
             key("pdd:handoff_stall_seconds_bucket", mode="catch_up", le="0.5"): 5.0}
    slow = {**stall, key("pdd:handoff_stall_seconds_count", mode="catch_up"): 6.0}  # one over 0.5 s
    assert SLOW_HANDOFF.total(slow) == 1
    assert counted(FaultKind.MD_SLOW, stall, slow) and not counted(FaultKind.WAN_SLOW, stall, slow)
    tpot = {key("pdd:tpot_seconds_count", path="p_rld_md"): 4.0,
            key("pdd:tpot_seconds_bucket", path="p_rld_md", le="0.1"): 4.0}
    paused = {**tpot, key("pdd:tpot_seconds_count", path="p_rld_md"): 5.0}  # a stream MD paused
    assert counted(FaultKind.MD_STOP, tpot, paused) and not counted(FaultKind.MD_SLOW, tpot, paused)
    assert not counted(FaultKind.MD_STOP, tpot, tpot)


def test_the_ledger_sums_counters_across_router_restarts():
    a = key("pdd:requests_total", path="p_md")
    b = key("pdd:fallbacks_total", reason="md_failed")
    ledger = CounterLedger()
    ledger.observe({a: 5, b: 1})  # the baseline: counted from here
    ledger.observe({a: 9, b: 1})
    assert ledger.snapshot() == {a: 4, b: 0} and ledger.restarts == 0
    ledger.observe({a: 2, b: 0})  # a new router: its counters count from 0
    assert ledger.restarts == 1 and ledger.snapshot() == {a: 6, b: 0}
    ledger.observe({a: 3, b: 2})
    assert ledger.snapshot() == {a: 7, b: 2} and ledger.restarts == 1


def test_each_fault_is_counted_only_by_its_own_kind_of_evidence():
    main = key("pdd:backend_failures_total", role="main", index="0", source="probe")
    relay = key("pdd:backend_failures_total", role="relay", index="0", source="request")
    drained = key("pdd:fallbacks_total", reason="md_rejected")
    before = {main: 1.0, relay: 0.0, drained: 0.0}
    assert counted(FaultKind.KILL_MD, before, {**before, main: 3.0})
    assert not counted(FaultKind.KILL_MD, before, {**before, relay: 1.0})  # RLD's failure is not MD's
    assert counted(FaultKind.KILL_RLD, before, {**before, relay: 1.0})
    assert not counted(FaultKind.KILL_P, before, {**before, relay: 1.0, main: 2.0})
    assert counted(FaultKind.MD_DRAIN, before, {**before, drained: 1.0})
    assert not counted(FaultKind.MD_DRAIN, before, before)  # nothing went up: not counted
    assert counted(FaultKind.WAN_DOWN, before, {**before, main: 2.0})
    assert counted(FaultKind.ROUTER_RESTART, before, before, restarts=1)
    assert not counted(FaultKind.ROUTER_RESTART, before, {**before, main: 9.0}, restarts=0)
    assert set(EVIDENCE) == set(ALL_KINDS) - {FaultKind.ROUTER_RESTART}


def test_evidence_names_metrics_and_labels_the_router_exports():
    router = (DOCS / "router.md").read_text()
    for kind, evidence in EVIDENCE.items():
        for item in evidence:
            if isinstance(item, Slower):
                assert f"`{item.histogram}`" in router, (kind, item)
                continue
            name, labels = item
            assert f"`{name}`" in router, (kind, name)
            for value in labels.values():
                assert f"`{value}`" in router, (kind, value)


# ------------------------------------------------------------------------------ the row
def test_the_row_sorts_every_request_into_exactly_one_outcome():
    refs = {"k": REF}
    fired = [KILL_P]
    records = [
        rec("200", received=REF, index=0, path="p_md"),
        rec("200", received=REF, index=1, path="p_rld_md"),
        rec("503", retry_after="1", index=2),
        rec("stream_502", received=REF[:2], index=3),
        rec("200", received=REF[:3] + REF[2:], index=4),  # completed with a duplicate
        rec("cut", received=REF[:1], sent=50.0, ended=51.0, index=5),  # no fault explains it
    ]
    row = evaluate("kill_p", records, refs, fired, uncounted=(), leaked=())
    assert (row.requests, row.completed_equal, row.completed_unequal) == (6, 2, 1)
    assert row.failed == {"503": 1, "stream_502": 1} and row.undocumented == {"cut": 1}
    assert (row.duplicated, row.skipped) == (1, 0)
    assert row.paths == {"p_md": 1, "p_rld_md": 1} and row.faults == {"kill_p": 1}
    assert not row.passed
    c = dict(zip(("scenario", "requests", "equal", "failed", "dup", "skip", "leaks", "faults", "verdict"), cells(row)))
    assert c["failed"] == "1 x 503, 1 x stream_502; UNDOCUMENTED 1 x cut; 1 completed UNEQUAL"
    assert c["verdict"].startswith("FAIL")


def test_a_clean_row_passes_and_any_single_problem_fails_it():
    refs = {"k": REF}
    clean = evaluate("baseline", [rec("200", received=REF)], refs, [])
    assert clean.passed and cells(clean)[-1] == "ok"
    assert not evaluate("x", [rec("200", received=REF, breaks=1)], refs, []).passed
    assert not evaluate("x", [rec("200", received=REF)], refs, [], uncounted=["kill_md at 8s"]).passed
    assert not evaluate("x", [rec("200", received=REF)], refs, [], leaked=["md: open_rooms = 1"]).passed
    assert not evaluate("x", [rec("200", received=REF)], refs, [], leftovers=["namespace x still exists"]).passed
    assert not evaluate("x", [rec("503")], refs, []).passed  # a 503 with no fault on
    lines = table([clean]).splitlines()
    assert lines[0].startswith("| scenario | requests | completed equal | failed with status | duplicated")
    assert lines[2] == "| baseline | 1 | 1 | 0 | 0 | 0 | 0 | - | ok |"


def test_slow_evidence_reads_bucket_bounds_the_router_exports():
    from sglang_pdd.router.front.metrics import RouterMetrics

    m = RouterMetrics()
    m.kv_transfer(0.2, 4096)
    m.kv_transfer(1.7, 4096)  # one over a second
    from prometheus_client.parser import text_string_to_metric_families

    scrape = counters((s.name, s.labels, s.value) for f in text_string_to_metric_families(m.render().decode())
                      for s in f.samples)
    assert SLOW_KV.total(scrape) == 1
    assert SLOW_HANDOFF.total(scrape) == 0
