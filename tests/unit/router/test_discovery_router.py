"""The router with service discovery, in process, on fake backends and a loopback Kubernetes API
(tests/support/fake_kube_api.py): pods join after the router's health check and leave by drain
while requests stream; nothing is lost and no request starts on a pod after it left."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from sglang_pdd.router.front import cli

from sglang_pdd.router.front import discovery_setup
from sglang_pdd.router.front.app import OPERATOR_HEADER, Router, build_app
from sglang_pdd.router.discovery.pods import Selector
from sglang_pdd.router.discovery.apply import Membership
from sglang_pdd.router.backends.pools import Pools
from tests.support.fake_backends import Fakes, Knobs, serve_app, truth, wait_until
from tests.support.fake_kube_api import FakeKubeApi, pod
from tests.support.flow_scenarios import PROMPT, flow_config

TOKEN = "operator-secret-0123456789"
PORT = lambda url: int(url.rsplit(":", 1)[1])  # noqa: E731


def kubeconfig(tmp_path, base: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "Config", "current-context": "a",
                                "clusters": [{"name": "a", "cluster": {"server": base}}],
                                "users": [{"name": "a", "user": {"token": "t"}}],
                                "contexts": [{"name": "a", "context": {"cluster": "a", "user": "a"}}]}))
    return str(path)


def test_flags_check_what_discovery_needs():
    def check(*argv):
        return discovery_setup.check_args(cli.parse_args(["--tokenizer-path", "m", *argv]))

    assert "--prefill and --relay are required" in check()
    assert check("--prefill", "http://p:1,8998", "--relay", "http://r:1") is None
    assert "need --service-discovery" in check("--prefill", "http://p:1,8998", "--relay", "http://r:1",
                                                "--relay-selector", "a=b")
    assert "--service-discovery needs" in check("--service-discovery", "--relay-selector", "a=b")
    assert check("--service-discovery", "--prefill-selector", "app=x", "role=p", "--relay-selector", "app=x,role=r") is None
    assert "need --main-selector" in check("--service-discovery", "--prefill-selector", "a=1", "--relay-selector",
                                           "a=2", "--main-discovery-context", "b")
    assert "not both" in check("--service-discovery", "--prefill-selector", "a=1", "--relay-selector", "a=2",
                               "--main-selector", "a=3", "--main-discovery-file", "md.json")
    args = cli.parse_args(["--tokenizer-path", "m", "--service-discovery", "--prefill-selector", "app=x", "role=p"])
    assert Selector.parse(args.prefill_selector) == Selector.parse("app=x,role=p")


async def stream_one(client, base: str) -> tuple[int, list[int]]:
    async with client.post(f"{base}/generate", json={"input_ids": PROMPT, "stream": True,
                                                     "sampling_params": {"max_new_tokens": 8}},
                           headers={OPERATOR_HEADER: TOKEN}) as resp:
        ids: list[int] = []
        async for line in resp.content:
            if line.startswith(b"data: {"):
                ids = json.loads(line[6:]).get("output_ids", ids)
        return resp.status, ids


def test_pods_join_after_health_and_leave_by_drain_while_requests_stream(router_sglang_state, tmp_path):
    knobs = Knobs(rld_token_delay_s=0.02)

    async def main():
        a, b = await Fakes(knobs).start(), await Fakes(knobs).start()
        b.prefilled = a.prefilled  # B serves as a second RLD for A's P
        api = FakeKubeApi()
        md_notes = {"pdd.sglang.ai/control-port": str(PORT(a.md_url)), "pdd.sglang.ai/wan-port": "1"}
        await api.put(pod("p-0", "prefill", "127.0.0.1", http_port=PORT(a.p_url),
                          annotations={"sglang.ai/bootstrap-port": "8998"}))
        await api.put(pod("r-a", "relay", "127.0.0.1", http_port=PORT(a.rld_url)))
        await api.put(pod("md-0", "main", "127.0.0.1", http_port=PORT(a.md_url), annotations=md_notes))
        async with serve_app(api.app()) as api_base:
            args = cli.parse_args(["--tokenizer-path", "m", "--service-discovery", "--service-discovery-namespace", "pdd",
                                   "--service-discovery-kubeconfig", kubeconfig(tmp_path, api_base),
                                   "--prefill-selector", "app=sglang", "pdd.sglang.ai/role=prefill",
                                   "--relay-selector", "app=sglang", "pdd.sglang.ai/role=relay",
                                   "--main-selector", "app=sglang", "pdd.sglang.ai/role=main"])
            pools = Pools([], [], [], allow_empty=True)
            picks: list[tuple[float, str]] = []  # (when, relay): the router's decisions, not arrivals
            pick = pools.pick

            def recorded_pick(*a, **k):
                chosen = pick(*a, **k)
                picks.append((time.monotonic(), chosen[1]))
                return chosen

            pools.pick = recorded_pick
            router = Router(pools, flow_config(), None, max_prompt_tokens=1000, served_model="tiny",
                            sglang_state=router_sglang_state, max_new_tokens_cap=64, operator_token=TOKEN,
                            health_check_interval_s=0)
            app = build_app(router)
            discovery = discovery_setup.build(args, router)
            app.on_startup.append(discovery.start)
            app.on_cleanup.insert(0, discovery.close)
            membership: Membership = discovery.membership
            async with serve_app(app) as base, aiohttp.ClientSession() as client:
                async with client.get(f"{base}/health") as resp:
                    assert resp.status == 503  # nothing found yet, or not yet health-checked
                await wait_until(lambda: len(pools.relay) == 1 and len(pools.prefill) == 1 and len(pools.main) == 1, 10)
                assert pools.prefill[0].bootstrap_port == 8998 and pools.main[0].control_url == a.md_url

                results: list[tuple[int, list[int]]] = []
                stop = asyncio.Event()

                async def client_loop():
                    while not stop.is_set():
                        results.append(await stream_one(client, base))

                loops = [asyncio.ensure_future(client_loop()) for _ in range(4)]
                await wait_until(lambda: len(results) >= 4, 10)
                knobs.health_status["rld"] = 503  # B's RLD not healthy yet: found but not joined
                await api.put(pod("r-b", "relay", "127.0.0.1", http_port=PORT(b.rld_url), ready=False))
                await api.put(pod("r-b", "relay", "127.0.0.1", http_port=PORT(b.rld_url)))
                await wait_until(lambda: any(e.kind == "seen" and e.url == b.rld_url for e in membership.events), 5)
                await asyncio.sleep(0.3)
                assert b.rld_url not in pools.relay and not b.records("rld", "generate")
                del knobs.health_status["rld"]
                await wait_until(lambda: b.rld_url in pools.relay, 5)
                await wait_until(lambda: len(b.records("rld", "generate")) >= 2, 10)  # B takes requests

                # r-a goes: first its deletion (Terminating), then the pod is gone
                terminating = pod("r-a", "relay", "127.0.0.1", http_port=PORT(a.rld_url))
                terminating["metadata"]["deletionTimestamp"] = "2026-12-07T00:00:00Z"
                await api.put(terminating)
                await wait_until(lambda: any(e.kind == "draining" and e.url == a.rld_url for e in membership.events), 5)
                drained_at = next(e.at for e in membership.events if e.kind == "draining" and e.url == a.rld_url)
                await api.delete("pdd", "r-a")
                await wait_until(lambda: a.rld_url not in pools.relay, 10)  # removed once idle
                served_before = len(results)
                await wait_until(lambda: len(results) >= served_before + 8, 10)  # B alone serves on
                stop.set()
                await asyncio.gather(*loops)

                assert all(status == 200 for status, _ in results), [s for s, _ in results if s != 200]
                assert all(ids == truth(PROMPT, 8) for _, ids in results)  # nothing lost, nothing duplicated
                # no request was sent to r-a after its drain (one picked just before may arrive after)
                assert [t for t, relay in picks if relay == a.rld_url and t >= drained_at] == []
                assert any(relay == a.rld_url for _, relay in picks) and any(relay == b.rld_url for _, relay in picks)
                removed = next(e.at for e in membership.events if e.kind == "removed" and e.url == a.rld_url)
                assert removed >= drained_at and a.rld_active == 0
                async with client.get(f"{base}/metrics") as resp:
                    assert resp.status == 200  # backends that joined late have metric labels
        await a.stop()
        await b.stop()

    asyncio.run(asyncio.wait_for(main(), 90))


def test_server_info_before_discovery_found_a_decoder_is_a_503(router_sglang_state):
    """With service discovery the pools start empty: /server_info answers 503 (no decode backend
    to ask), as when none answers, not a 500 from indexing an empty pool."""

    async def main():
        router = Router(Pools([], [], [], allow_empty=True), flow_config(), None, max_prompt_tokens=1000,
                        served_model="tiny", sglang_state=router_sglang_state, max_new_tokens_cap=64,
                        operator_token=TOKEN, health_check_interval_s=0)
        async with serve_app(build_app(router)) as base, aiohttp.ClientSession() as client:
            async with client.get(f"{base}/server_info") as resp:
                assert resp.status == 503, await resp.text()
                assert "no decode backend" in (await resp.json())["error"]

    asyncio.run(asyncio.wait_for(main(), 30))
