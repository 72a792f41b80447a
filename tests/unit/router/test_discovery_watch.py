"""Service discovery's client against a loopback server speaking the Kubernetes API's pod list and
watch JSON (tests/support/fake_kube_api.py): list, watch from the list's version, re-list after
410 Gone, back off on errors; MD's discovery file; a kubeconfig read by the official package."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import pytest

from sglang_pdd.router.discovery import watch as discovery_watch
from sglang_pdd.router.discovery.pods import DiscoveryState, Selector
from sglang_pdd.router.discovery.watch import ApiEndpoint, FileWatcher, PodWatcher, common_label_selector
from tests.support.fake_backends import serve_app, wait_until
from tests.support.fake_kube_api import FakeKubeApi, pod

SELECTORS = {role: Selector.parse(["app=sglang", f"pdd.sglang.ai/role={role}"]) for role in ("prefill", "relay")}
P_NOTES = {"sglang.ai/bootstrap-port": "8998"}


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 30))


class Seen:
    """The changes the watcher handed over, as (kind, url)."""

    def __init__(self):
        self.changes: list[tuple[str, str]] = []

    async def __call__(self, update):
        self.changes += [(type(c).__name__, c.backend.url) for c in update.changes]


async def watching(api: FakeKubeApi, base: str, namespace="pdd", token="t0k"):
    seen = Seen()
    watcher = PodWatcher(ApiEndpoint(base, token=token), namespace, DiscoveryState(SELECTORS, 30000), seen)
    session = aiohttp.ClientSession()
    task = asyncio.ensure_future(watcher.run(session))
    return watcher, seen, task, session


async def stop(task, session):
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await session.close()


def test_the_server_side_selector_is_the_pairs_every_role_shares():
    assert common_label_selector(DiscoveryState(SELECTORS)) == "app=sglang"
    other = {"prefill": Selector.parse("a=1"), "relay": Selector.parse("b=2")}
    assert common_label_selector(DiscoveryState(other)) == ""


def test_list_then_watch_from_the_lists_version_hands_over_every_change_once(monkeypatch):
    monkeypatch.setattr(discovery_watch, "LIST_PAGE", 2)  # three pods: two pages

    async def main():
        api = FakeKubeApi()
        await api.put(pod("p-0", "prefill", "10.0.0.1", annotations=P_NOTES))
        await api.put(pod("r-0", "relay", "10.0.0.2"))
        await api.put(pod("r-1", "relay", "10.0.0.3", ready=False))
        await api.put(pod("other", "relay", "10.0.0.9", ns="elsewhere"))
        async with serve_app(api.app()) as base:
            watcher, seen, task, session = await watching(api, base)
            await asyncio.wait_for(watcher.stats.synced.wait(), 5)
            assert sorted(seen.changes) == [("Join", "http://10.0.0.1:30000"), ("Join", "http://10.0.0.2:30000")]
            assert [q.get("continue") for q in api.lists()] == [None, "2"]
            assert api.lists()[0]["labelSelector"] == "app=sglang" and api.authorization[0] == "Bearer t0k"
            await wait_until(lambda: len(api.watches()) == 1, 5)
            assert api.watches()[0]["resourceVersion"] == "104"  # the list's version: nothing missed
            await api.put(pod("r-1", "relay", "10.0.0.3"))  # became Ready
            await api.delete("pdd", "r-0")
            await wait_until(lambda: len(seen.changes) == 4, 5)
            assert seen.changes[2:] == [("Join", "http://10.0.0.3:30000"), ("Leave", "http://10.0.0.2:30000")]
            await stop(task, session)

    run(main())


def test_a_watch_the_server_ends_is_reopened_from_the_last_version_seen(monkeypatch):
    monkeypatch.setattr(discovery_watch, "WATCH_TIMEOUT_S", 1)

    async def main():
        api = FakeKubeApi()
        async with serve_app(api.app()) as base:
            watcher, seen, task, session = await watching(api, base)
            await asyncio.wait_for(watcher.stats.synced.wait(), 5)
            await api.put(pod("r-0", "relay", "10.0.0.2"))
            await wait_until(lambda: len(api.watches()) >= 2, 5)  # timed out, reopened
            assert api.watches()[1]["resourceVersion"] == "101"  # after r-0's event
            assert seen.changes == [("Join", "http://10.0.0.2:30000")] and len(api.lists()) == 1
            await stop(task, session)

    run(main())


def test_410_gone_relists_and_the_relist_leaves_what_went_while_unwatched():
    async def main():
        api = FakeKubeApi()
        await api.put(pod("r-0", "relay", "10.0.0.2"))
        await api.put(pod("r-1", "relay", "10.0.0.3"))
        async with serve_app(api.app()) as base:
            watcher, seen, task, session = await watching(api, base)
            await wait_until(lambda: len(api.watches()) == 1, 5)
            # changes the watch will never see: the history is compacted before it could send them
            async with api.changed:  # no wake-up of the open watch in between
                api.version += 1
                api.pods.pop(("pdd", "r-0"))
                api.pods[("pdd", "r-2")] = pod("r-2", "relay", "10.0.0.4")
            await api.expire_watches()
            await wait_until(lambda: len(api.lists()) == 2, 5)
            await wait_until(lambda: len(seen.changes) == 4, 5)
            assert watcher.stats.gone == 1
            assert sorted(seen.changes[2:]) == [("Join", "http://10.0.0.4:30000"), ("Leave", "http://10.0.0.2:30000")]
            await stop(task, session)

    run(main())


def test_api_errors_back_off_and_recover(monkeypatch):
    monkeypatch.setattr(discovery_watch, "BACKOFF_S", 0.05)

    async def main():
        api = FakeKubeApi()
        await api.put(pod("r-0", "relay", "10.0.0.2"))
        api.fail_next(3, 503)
        async with serve_app(api.app()) as base:
            watcher, seen, task, session = await watching(api, base)
            await asyncio.wait_for(watcher.stats.synced.wait(), 10)
            assert watcher.stats.errors == 3 and "HTTP 503" in watcher.stats.last_error
            assert seen.changes == [("Join", "http://10.0.0.2:30000")]
            await stop(task, session)

    run(main())


def test_the_main_discovery_file_joins_and_leaves_md_and_keeps_the_last_good_list(tmp_path):
    path = tmp_path / "md.json"
    md = {"url": "http://md-0:30002", "control_url": "http://md-0:31002", "wan": "md-0:17000"}

    async def main():
        seen = Seen()
        watcher = FileWatcher(str(path), seen, poll_s=0.01)
        await watcher.poll_once()  # missing: nothing, no crash
        path.write_text(json.dumps([md]))
        await watcher.poll_once()
        assert seen.changes == [("Join", "http://md-0:30002")]
        path.write_text("[{not json")
        os.utime(path, ns=(1, 1))
        await watcher.poll_once()
        assert watcher.errors == 1 and seen.changes == [("Join", "http://md-0:30002")]
        yaml_path = tmp_path / "md.yaml"
        yaml_path.write_text("- url: http://md-1:30002\n  control_url: http://md-1:31002\n  wan: md-1:17000\n")
        watcher.path = str(yaml_path)
        await watcher.poll_once()
        assert seen.changes[1:] == [("Leave", "http://md-0:30002"), ("Join", "http://md-1:30002")]

    run(main())


def test_a_kubeconfig_is_read_by_the_official_client_and_its_token_sent(tmp_path):
    pytest.importorskip("kubernetes")

    async def main():
        api = FakeKubeApi()
        await api.put(pod("r-0", "relay", "10.0.0.2"))
        async with serve_app(api.app()) as base:
            config = tmp_path / "kubeconfig"
            config.write_text(json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "a",
                "clusters": [{"name": "a", "cluster": {"server": base}}, {"name": "b", "cluster": {"server": base}}],
                "users": [{"name": "a", "user": {"token": "tok-a"}}, {"name": "b", "user": {"token": "tok-b"}}],
                "contexts": [{"name": "a", "context": {"cluster": "a", "user": "a", "namespace": "pdd"}},
                             {"name": "b", "context": {"cluster": "b", "user": "b"}}]}))
            endpoint = discovery_watch.endpoint_for(str(config), "b")
            assert endpoint.server == base and endpoint.headers() == {"Authorization": "Bearer tok-b"}
            assert discovery_watch.endpoint_for(str(config), None).default_namespace == "pdd"
            seen = Seen()
            watcher = PodWatcher(endpoint, "pdd", DiscoveryState(SELECTORS), seen)
            async with aiohttp.ClientSession() as session:
                await watcher._list(session)
            assert seen.changes == [("Join", "http://10.0.0.2:30000")] and api.authorization == ["Bearer tok-b"]

    run(main())


@pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="KUBECONFIG unset: no real API server to list pods from")
def test_discovery_against_a_real_api_server():
    """Lists and watches the pods of $KUBECONFIG's cluster (namespace PDD_DISCOVERY_NAMESPACE,
    default 'default') for a few seconds: the client speaks the real API, whatever it finds."""

    async def main():
        seen = []

        async def on_update(update):
            seen.extend(update.changes)

        endpoint = discovery_watch.endpoint_for(os.environ["KUBECONFIG"].split(os.pathsep)[0],
                                                os.environ.get("PDD_DISCOVERY_CONTEXT"))
        state = DiscoveryState({"relay": Selector.parse(os.environ.get("PDD_DISCOVERY_SELECTOR",
                                                                       "pdd.sglang.ai/role=relay"))})
        watcher = PodWatcher(endpoint, os.environ.get("PDD_DISCOVERY_NAMESPACE", "default"), state, on_update)
        async with aiohttp.ClientSession() as session:
            task = asyncio.ensure_future(watcher.run(session))
            await asyncio.wait_for(watcher.stats.synced.wait(), 30)
            await asyncio.sleep(3)  # the watch opens and holds
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert watcher.stats.lists == 1 and watcher.stats.errors == 0, watcher.stats.last_error
        assert watcher.stats.watches >= 1

    asyncio.run(main())
