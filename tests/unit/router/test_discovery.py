"""Service discovery's pure logic on constructed pod objects (SMG's pattern): which pods are
backends, and the join / drain / leave changes each watch event or re-list makes."""

from __future__ import annotations

import logging

import pytest

from sglang_pdd.router.discovery.pods import (ADVERTISE_HOST, BOOTSTRAP_PORT, CONTROL_PORT, WAN_PORT, DiscoveredBackend,
                                         DiscoveryState, Drain, Join, Leave, Selector, SelectorError,
                                         backends_from_file_entries, file_changes)

ROLE = "pdd.sglang.ai/role"
SELECTORS = {role: Selector.parse([f"app=sglang", f"{ROLE}={role}"]) for role in ("prefill", "relay", "main")}


def pod(name, role=None, ready=True, ip="10.0.0.1", labels=None, annotations=None, deleting=False, ns="pdd"):
    labels = dict(labels if labels is not None else {"app": "sglang", ROLE: role})
    notes = dict(annotations if annotations is not None else {
        "prefill": {BOOTSTRAP_PORT: "8998", CONTROL_PORT: "31000"},
        "main": {CONTROL_PORT: "31002", WAN_PORT: "17000"}}.get(role, {}))
    meta = {"name": name, "namespace": ns, "labels": labels, "annotations": notes, "resourceVersion": "1"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True" if ready else "False"}]}}


def state():
    return DiscoveryState(SELECTORS, default_http_port=30000)


def kinds(update):
    return [(type(c).__name__, c.backend.role, c.backend.url) for c in update.changes]


def test_selector_parses_pairs_and_matches_only_when_every_pair_is_equal():
    sel = Selector.parse(["app=sglang,pdd.sglang.ai/role=prefill"])
    assert sel == Selector.parse(["pdd.sglang.ai/role=prefill", "app=sglang"])
    assert sel.matches({"app": "sglang", ROLE: "prefill", "extra": "x"})
    assert not sel.matches({"app": "sglang"})
    assert not sel.matches({"app": "sglang", ROLE: "relay"})
    for bad in (["app"], ["=x"], []):
        with pytest.raises(SelectorError):
            Selector.parse(bad)


def test_a_ready_prefill_pod_joins_with_its_ports_from_annotations():
    s = state()
    update = s.apply("ADDED", pod("p-0", "prefill", ip="10.1.2.3"))
    assert update.changes == [Join(DiscoveredBackend("prefill", "pdd/p-0", "http://10.1.2.3:30000", bootstrap_port=8998,
                                                     control_url="http://10.1.2.3:31000"))]


def test_md_gets_control_and_wan_from_annotations_and_an_advertised_host():
    s = state()
    notes = {CONTROL_PORT: "31002", WAN_PORT: "17000", ADVERTISE_HOST: "{pod}.md.{namespace}.svc.clusterset.local",
             "pdd.sglang.ai/http-port": "30002", "pdd.sglang.ai/control-scheme": "https"}
    (join,) = s.apply("ADDED", pod("md-1", "main", annotations=notes)).changes
    host = "md-1.md.pdd.svc.clusterset.local"
    assert join.backend == DiscoveredBackend("main", "pdd/md-1", f"http://{host}:30002",
                                             control_url=f"https://{host}:31002", wan_addr=f"{host}:17000")


def test_a_pod_joins_only_once_ready_and_drains_when_it_stops_being_ready():
    s = state()
    assert s.apply("ADDED", pod("r-0", "relay", ready=False)).changes == []
    assert kinds(s.apply("MODIFIED", pod("r-0", "relay"))) == [("Join", "relay", "http://10.0.0.1:30000")]
    assert s.apply("MODIFIED", pod("r-0", "relay")).changes == []  # no change, no event
    (drain,) = s.apply("MODIFIED", pod("r-0", "relay", ready=False)).changes
    assert isinstance(drain, Drain) and drain.why == "not Ready"
    assert kinds(s.apply("MODIFIED", pod("r-0", "relay"))) == [("Join", "relay", "http://10.0.0.1:30000")]


def test_a_pod_being_deleted_drains_before_it_is_gone_then_leaves_once():
    s = state()
    s.apply("ADDED", pod("r-0", "relay"))
    (drain,) = s.apply("MODIFIED", pod("r-0", "relay", deleting=True)).changes
    assert isinstance(drain, Drain) and drain.why == "being deleted"
    assert s.apply("DELETED", pod("r-0", "relay", deleting=True)).changes == []  # already out
    s.apply("ADDED", pod("r-1", "relay", ip="10.0.0.2"))
    (leave,) = s.apply("DELETED", pod("r-1", "relay", ip="10.0.0.2")).changes
    assert isinstance(leave, Leave) and leave.backend.url == "http://10.0.0.2:30000"
    assert s.backends == {}


def test_relabel_moves_a_pod_out_of_its_role_and_into_another():
    s = state()
    s.apply("ADDED", pod("x", "relay"))
    update = s.apply("MODIFIED", pod("x", "prefill"))
    assert kinds(update) == [("Drain", "relay", "http://10.0.0.1:30000"), ("Join", "prefill", "http://10.0.0.1:30000")]
    (drain,) = s.apply("MODIFIED", pod("x", labels={"app": "sglang"})).changes
    assert isinstance(drain, Drain) and "no longer match" in drain.why


def test_a_new_ip_for_the_same_pod_drains_the_old_address_and_joins_the_new():
    s = state()
    s.apply("ADDED", pod("md-0", "main", ip="10.0.0.5"))
    update = s.apply("MODIFIED", pod("md-0", "main", ip="10.0.0.6"))
    assert kinds(update) == [("Drain", "main", "http://10.0.0.5:30000"), ("Join", "main", "http://10.0.0.6:30000")]


def test_two_roles_on_one_pod_are_refused_with_a_clear_log_once(caplog):
    sels = {"prefill": Selector.parse("app=sglang"), "relay": Selector.parse(["app=sglang", f"{ROLE}=relay"])}
    s = DiscoveryState(sels)
    with caplog.at_level(logging.ERROR, logger="sglang_pdd.router.discovery.pods"):
        update = s.apply("ADDED", pod("both", "relay"))
        again = s.apply("MODIFIED", pod("both", "relay"))
    assert update.changes == [] and again.changes == [] and again.refused == []
    assert update.refused == [("pdd/both", "its labels match the selectors of prefill and relay: one pod serves one role")]
    assert [r.getMessage() for r in caplog.records] == [
        "service discovery: pod pdd/both refused: its labels match the selectors of prefill and relay: one pod serves "
        "one role"]


def test_a_pod_missing_the_annotation_its_role_needs_is_refused_and_joins_once_it_has_it():
    s = state()
    update = s.apply("ADDED", pod("md-0", "main", annotations={CONTROL_PORT: "31002"}))
    assert update.changes == [] and update.refused == [("pdd/md-0", f"pod pdd/md-0 has no annotation {WAN_PORT}")]
    bad = s.apply("MODIFIED", pod("md-0", "main", annotations={CONTROL_PORT: "31002", WAN_PORT: "99999"}))
    assert "is not a port" in bad.refused[0][1]
    assert kinds(s.apply("MODIFIED", pod("md-0", "main"))) == [("Join", "main", "http://10.0.0.1:30000")]


def test_a_relist_after_410_gone_leaves_the_pods_that_went_and_joins_the_new_ones():
    s = state()
    s.apply("ADDED", pod("p-0", "prefill", ip="10.0.0.1"))
    s.apply("ADDED", pod("r-0", "relay", ip="10.0.0.2"))
    s.apply("ADDED", pod("r-1", "relay", ip="10.0.0.3", ready=False))
    # while the watch was down: p-0 deleted, r-0 unchanged, r-1 became Ready, md-0 added
    update = s.relist([pod("r-0", "relay", ip="10.0.0.2"), pod("r-1", "relay", ip="10.0.0.3"),
                       pod("md-0", "main", ip="10.0.0.4")])
    assert sorted(kinds(update)) == [("Join", "main", "http://10.0.0.4:30000"),
                                     ("Join", "relay", "http://10.0.0.3:30000"),
                                     ("Leave", "prefill", "http://10.0.0.1:30000")]
    assert {b.url for b in s.backends.values()} == {"http://10.0.0.2:30000", "http://10.0.0.3:30000",
                                                   "http://10.0.0.4:30000"}
    assert s.relist([pod("r-0", "relay", ip="10.0.0.2"), pod("r-1", "relay", ip="10.0.0.3"),
                     pod("md-0", "main", ip="10.0.0.4")]).changes == []


def test_unknown_event_types_are_errors_and_bookmarks_change_nothing():
    s = state()
    assert s.apply("BOOKMARK", {"metadata": {"resourceVersion": "5"}}).changes == []
    with pytest.raises(ValueError):
        s.apply("ERROR", {})


def test_discovery_file_entries_and_their_changes():
    one = backends_from_file_entries([{"url": "http://md:30002", "control_url": "http://md:31002", "wan": "md:17000"}],
                                     "f.json")
    assert one == [DiscoveredBackend("main", "http://md:30002", "http://md:30002", control_url="http://md:31002",
                                     wan_addr="md:17000")]
    assert [type(c).__name__ for c in file_changes({}, one)] == ["Join"]
    assert file_changes({b.url: b for b in one}, one) == []
    assert [type(c).__name__ for c in file_changes({b.url: b for b in one}, [])] == ["Leave"]
    for bad in ({"url": "x"}, [{"url": "a", "control_url": "b"}], [{"url": "a", "control_url": "b", "wan": "nohost"}],
                [{"url": "a", "control_url": "b", "wan": "h:1", "extra": 1}]):
        with pytest.raises(ValueError):
            backends_from_file_entries(bad, "f.json")
