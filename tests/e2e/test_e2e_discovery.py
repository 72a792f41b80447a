"""End-to-end service discovery: a real router process finds real SGLang servers as pods on a
loopback server speaking the Kubernetes API's list/watch JSON (tests/support/fake_kube_api.py),
and MD in a watched file. While requests stream, a second RLD pod joins (after the router's
health check) and the first one leaves (drained: its requests finish, no new one reaches it,
then it is dropped), three times over. Nothing is lost: every request ends with all its tokens, and
each prompt's output is the same whichever RLD served it (greedy, float32).

Each RLD is reached through a byte-forwarding proxy that notes the time each request
arrives, so "no request after it left" is measured where the server sees it.

Against a real API server: tests/unit/router/test_discovery_watch.py (when KUBECONFIG is set)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time

import pytest
from tests.conftest import EXACT_ARGS, TEST_DESTINATION_WAIT_MS, TEST_ROUTER_ARGS, _require_sglang
from tests.support.fake_kube_api import FakeKubeApi, pod
from tests.support.waiting import wait_until

from sglang_pdd.launcher.http import call_json, get_json, stream_events

pytestmark = [pytest.mark.e2e, pytest.mark.full, pytest.mark.own_cluster]

MAX_NEW = 12
PROMPTS = [[1] + [100 + 7 * i + j for j in range(24)] for i in range(4)]


class LoopThread:
    """An asyncio loop in a thread: the fake API server and the proxy run there."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class ArrivalProxy:
    """Forwards TCP to ``upstream``; notes time.monotonic() of each HTTP request that starts
    (``POST /generate``) on any connection."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.arrivals: list[float] = []
        self.server = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _client(self, reader, writer):
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return

        async def pipe(src, dst, note: bool):
            try:
                while data := await src.read(1 << 16):
                    if note:
                        self.arrivals += [time.monotonic()] * data.count(b"POST /generate ")
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w, True), pipe(up_r, writer, False))


def backends(router_url: str) -> dict:
    return {b["url"]: b for b in get_json(f"{router_url}/pdd/backends")["backends"]}


@contextlib.contextmanager
def discovery_cluster(run_root):
    from sglang_pdd.launcher.processes import ProcessGroup
    from sglang_pdd.launcher.topology import (ServerSpec, Topology, free_port, server_argv, server_env,
                                              wan_emulator_argvs, write_operator_token, write_wan_key)

    model = _require_sglang()
    run_dir = run_root / "cluster-discovery"
    topo = Topology.on_free_ports()
    relay_b = ServerSpec("relay-1", "relay", free_port(), "dc-a")
    topo.prefill.extra_args += ["--pdd-wan-destination-wait-ms", str(TEST_DESTINATION_WAIT_MS)]
    servers = [topo.prefill, topo.relay, relay_b, topo.main]
    for spec in servers:
        spec.extra_args += list(EXACT_ARGS)
    key, token = write_wan_key(run_dir / "wan.key"), write_operator_token(run_dir / "operator.token")
    procs = ProcessGroup(run_dir / "logs")
    loop = LoopThread()
    api = FakeKubeApi.__new__(FakeKubeApi)
    try:
        async def start_api():
            from aiohttp import web

            api.__init__()
            runner = web.AppRunner(api.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            proxies = {}
            for spec in (topo.relay, relay_b):
                proxy = ArrivalProxy(spec.port)
                proxies[spec.name] = (proxy, await proxy.start())
            return runner.addresses[0][1], proxies

        api_port, proxies = loop.run(start_api())
        for spec in servers:
            procs.start(spec.name, server_argv(spec, model, str(key), topo.intra_dc_transport),
                        health_url=f"{spec.url}/health", env=server_env(spec))
        for name, argv, health_url in wan_emulator_argvs(topo):
            procs.start(name, argv, health_url=health_url)
        kubeconfig = run_dir / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "a",
            "clusters": [{"name": "a", "cluster": {"server": f"http://127.0.0.1:{api_port}"}}],
            "users": [{"name": "a", "user": {"token": "test"}}],
            "contexts": [{"name": "a", "context": {"cluster": "a", "user": "a", "namespace": "pdd"}}]}))
        md_file = run_dir / "md.json"
        md_file.write_text(json.dumps([{"url": topo.main.url, "control_url": topo.main.control_url,
                                        "wan": topo.wan_peer(0)}]))
        router_argv = [sys.executable, "-m", "sglang_pdd.router", "--host", "127.0.0.1", "--port",
                       str(topo.router_port), "--tokenizer-path", model, "--control-key-file", str(key),
                       "--operator-token-file", str(token), "--service-discovery",
                       "--service-discovery-kubeconfig", str(kubeconfig), "--service-discovery-namespace", "pdd",
                       "--prefill-selector", "app=sglang", "pdd.sglang.ai/role=prefill",
                       "--relay-selector", "app=sglang", "pdd.sglang.ai/role=relay",
                       "--main-discovery-file", str(md_file), "--wan-rtt-ms", str(2 * topo.wan.latency_ms),
                       *TEST_ROUTER_ARGS]
        procs.start("router", router_argv, health_url=f"{topo.router_url}/metrics")
        procs.wait_healthy(timeout_s=600)
        yield topo, relay_b, procs, loop, api, proxies
    finally:
        procs.stop_all()
        loop.stop()


def test_pods_join_and_leave_while_requests_stream_and_nothing_is_lost(run_root):
    with discovery_cluster(run_root) as (topo, relay_b, procs, loop, api, proxies):
        router = topo.router_url
        p_notes = {"sglang.ai/bootstrap-port": str(topo.prefill.bootstrap_port),
                   "pdd.sglang.ai/control-port": str(topo.prefill.control_port)}
        loop.run(api.put(pod("p-0", "prefill", "127.0.0.1", http_port=topo.prefill.port, annotations=p_notes)))
        # each RLD server behind its proxy; a pod (by name) is one life of a server
        urls = {server: f"http://127.0.0.1:{port}" for server, (_, port) in proxies.items()}
        loop.run(api.put(pod("r-0", "relay", "127.0.0.1", http_port=proxies["relay-0"][1])))
        assert wait_until(lambda: call_json("GET", f"{router}/health")[0] == 200, 60)
        assert topo.main.url in backends(router)  # from the discovery file

        results: list[tuple[int, list[int], object]] = []
        stop = threading.Event()

        def client(i: int):
            n = i
            while not stop.is_set():
                prompt = PROMPTS[n % len(PROMPTS)]
                n += 1
                ids, finish = [], None
                body = {"input_ids": prompt, "stream": True,
                        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
                try:
                    for event in stream_events(f"{router}/generate", body):
                        ids = event.get("output_ids", ids)
                        finish = event["meta_info"].get("finish_reason") or finish
                except Exception as e:  # noqa: BLE001 - a lost request, reported below
                    finish = repr(e)
                results.append((n - 1, ids, finish))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert wait_until(lambda: len(results) >= 6, 120)

        timings = {"join": [], "drain": [], "removed": []}
        late_checks = []
        # three cycles: the other RLD joins (a new pod), then the serving one leaves
        cycles = [("r-1", "relay-1", "r-0", "relay-0"), ("r-0b", "relay-0", "r-1", "relay-1"),
                  ("r-1b", "relay-1", "r-0b", "relay-0")]
        for joining, join_server, leaving_name, leave_server in cycles:
            t_ready = time.monotonic()
            loop.run(api.put(pod(joining, "relay", "127.0.0.1", http_port=proxies[join_server][1])))
            assert wait_until(lambda: backends(router).get(urls[join_server], {}).get("pickable"), 30, poll_s=0.02)
            timings["join"].append(time.monotonic() - t_ready)
            served = len(results)
            assert wait_until(lambda: len(results) >= served + 6, 120)

            leaving = pod(leaving_name, "relay", "127.0.0.1", http_port=proxies[leave_server][1])
            leaving["metadata"]["deletionTimestamp"] = "2026-12-07T00:00:00Z"
            t_delete = time.monotonic()
            loop.run(api.put(leaving))
            assert wait_until(lambda: backends(router).get(urls[leave_server], {}).get("draining"), 30, poll_s=0.01)
            t_drained = time.monotonic()
            inflight_at_drain = backends(router).get(urls[leave_server], {}).get("inflight", 0)
            timings["drain"].append(t_drained - t_delete)
            loop.run(api.delete("pdd", leaving_name))
            assert wait_until(lambda: urls[leave_server] not in backends(router), 60, poll_s=0.02)
            timings["removed"].append(time.monotonic() - t_delete)
            served = len(results)
            assert wait_until(lambda: len(results) >= served + 6, 120)  # the other RLD alone serves on
            # requests that reached the left server since its drain (it has not joined again yet)
            late = [t for t in proxies[leave_server][0].arrivals if t > t_drained]
            late_checks.append((leave_server, late, inflight_at_drain, t_drained))
        stop.set()
        for t in threads:
            t.join(120)

        # nothing lost: every request ended by length with all its tokens, the same tokens for
        # the same prompt whichever RLD (or MD) served it
        lost = [(n, f) for n, ids, f in results if not (isinstance(f, dict) and f.get("type") == "length"
                                                         and len(ids) == MAX_NEW)]
        assert results and not lost, lost
        by_prompt: dict[int, set] = {}
        for n, ids, _ in results:
            by_prompt.setdefault(n % len(PROMPTS), set()).add(tuple(ids))
        assert all(len(outputs) == 1 for outputs in by_prompt.values()), by_prompt
        # no request reached a server after its drain (checked before it joined again) but those
        # the router had picked before: in flight at the drain, in transit for at most a moment
        for server, late, inflight, t_drained in late_checks:
            assert len(late) <= inflight and all(t < t_drained + 1.0 for t in late), (server, late, inflight)
        assert all(proxy.arrivals for proxy, _ in proxies.values())

        def spread(xs):
            return f"median {sorted(xs)[len(xs) // 2] * 1000:.0f} ms (min {min(xs) * 1000:.0f}, max {max(xs) * 1000:.0f})"

        print(f"\ndiscovery under streaming load (3 clients, {len(results)} requests, lost 0), 3 join/leave cycles: "
              f"join (Ready -> pickable) {spread(timings['join'])}; drain (deletion -> draining) "
              f"{spread(timings['drain'])}; removed (deletion -> dropped once idle) {spread(timings['removed'])}; "
              f"requests reaching a drained RLD after its drain: {[len(c[1]) for c in late_checks]} "
              f"(in flight at the drain {[c[2] for c in late_checks]})")
