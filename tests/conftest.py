"""Shared fixtures. Real-server fixtures are session-scoped: SGLang takes ~30 s to start on CPU."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def require_sglang_import():
    """Skip (error under CI) when SGLang is not installed; for unit tests of the SGLang glue."""
    try:
        import sglang  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SGLang not installed here ({e}); run scripts/setup.sh")


def _require_sglang(mla: bool = False):
    """The tiny model's path (``mla``: the DeepSeek-V2-style one), or skip outside CI."""
    try:
        import sglang  # noqa: F401
        from sglang_pdd.launcher import cluster

        return cluster.default_mla_model_path() if mla else cluster.default_model_path()
    except (ImportError, FileNotFoundError) as e:
        if os.environ.get("CI"):
            raise  # CI must run the end-to-end tests, never skip them
        pytest.skip(f"real SGLang not set up here ({e}); run scripts/setup.sh")


@pytest.fixture(scope="session")
def run_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pdd-runs")


# Every server under test computes in float32: rounding then differs between one extend pass and
# step-by-step decode by ~1e-6 in logprob, far below the 0.01 margins the tests' prompts keep
# between the best two tokens, so greedy outputs must be equal, with no excuse. (bf16 logits
# come in steps of ~0.004-0.016, where ties are common.) The MLA model keeps its default.
EXACT_ARGS = ("--dtype", "float32")


@contextlib.contextmanager
def plain_server(run_root, model: str, name: str = "single", extra_args: tuple = EXACT_ARGS):
    """A plain SGLang server (no PD) on ``model``; yields its URL. It sleeps when idle
    (topology.server_argv), so keeping the reference up beside a cluster costs next to nothing."""
    from sglang_pdd.launcher.processes import ProcessGroup
    from sglang_pdd.launcher.topology import CPU_ENV, ServerSpec, free_port, server_argv

    spec = ServerSpec(name, None, free_port(), extra_args=list(extra_args))
    with ProcessGroup(run_root / f"{name}-logs") as procs:
        # the same serving options as the router (TEST_ROUTER_ARGS): chat and tool calls compare
        procs.start(name, server_argv(spec, model) + TEST_SERVING_ARGS, health_url=f"{spec.url}/health",
                    env=CPU_ENV)
        procs.wait_healthy(timeout_s=600)
        yield spec.url


@pytest.fixture(scope="session")
def single_server(run_root):
    """A plain SGLang server (no PD): the reference for greedy output_ids."""
    with plain_server(run_root, _require_sglang()) as url:
        yield url


# A slow emulated WAN (0.5 Mbit/s, 20 ms one way) so the tiny model's KV (512 B/token) takes
# long enough to cross that RLD has streamed eager tokens before MD takes over.
TEST_WAN_GBPS = 0.0005
# SGLang serving options shared by the router and the reference server (the tiny model has no
# chat template of its own).
TEST_SERVING_ARGS = ["--chat-template", "chatml", "--tool-call-parser", "qwen25"]
# Tests steer paths with pdd_options, an operator-only option, hence --every-client-is-operator.
# No /health probes: each is a one-token request on every backend, which tests that count a
# server's queued requests (support/takeover.py, the abort tests) would see; test_e2e_multi probes.
TEST_ROUTER_ARGS = ["--max-wan-transfer-ms", "50", "--wan-timeout-s", "6", "--every-client-is-operator",
                    "--health-check-interval-s", "0", *TEST_SERVING_ARGS]
TEST_DESTINATION_WAIT_MS = 10000


class OneAtATime:
    """The servers under test, one group alive at a time: on two cores a second cluster's
    schedulers slow every request of the first and timing flakes follow. Groups are keyed by
    configuration, so every module asking for the same one shares it; asking for another stops
    the current one first."""

    def __init__(self):
        self.key = None
        self._stack: Optional[contextlib.ExitStack] = None
        self._value = None

    def get(self, key, start):
        """The group for ``key``, started with ``start()`` (a context manager) if it is not the
        one alive."""
        if key != self.key:
            self.stop()
            stack = contextlib.ExitStack()
            try:
                value = stack.enter_context(start())
            except BaseException:
                stack.close()
                raise
            self.key, self._stack, self._value = key, stack, value
        return self._value

    def stop(self) -> None:
        stack, self.key, self._stack, self._value = self._stack, None, None, None
        if stack is not None:
            stack.close()


@pytest.fixture(scope="session")
def servers_under_test():
    group = OneAtATime()
    yield group
    group.stop()


def warm_up(cluster) -> None:
    """Requests through P, RLD and MD before any test: the first request after start pays
    one-time costs (connections, Mooncake and WAN handshakes, lazy initialisation) that would
    otherwise land on whichever test runs first. One of them is a streamed take-over
    (support/takeover.py): the first pause and first handoff on a cold cluster lag RLD by 20-odd tokens."""
    from tests.support.takeover import stream_taken_over

    from sglang_pdd.launcher.http import post_json

    for options in ({"path": "p_rld_md", "handoff_mode": "one_shot"}, {"path": "p_md"}):
        post_json(f"{cluster.topology.router_url}/generate", {
            "text": "warm up", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "pdd_options": options}, timeout=120)
    stream_taken_over(cluster, {"text": "warm up", "sampling_params": {"max_new_tokens": 32, "temperature": 0},
                                "pdd_options": {"path": "p_rld_md", "handoff_mode": "one_shot"}}, 2)


@contextlib.contextmanager
def start_pdd_cluster(run_root, name: str = "cluster", page_size: int = 1, model_path: Optional[str] = None,
                      prefill_tp: int = 1, main_tp: int = 1, intra_dc_transport: str = "auto",
                      extra_args: tuple = EXACT_ARGS, control_tls=None):
    """P + RLD + MD + WAN emulator + router, as real processes, warmed up (a context manager);
    ``prefill_tp``: P's --tp; ``main_tp``: MD's --tp (one emulated WAN link per MD rank);
    ``control_tls``: launcher.topology.ControlTlsFiles, the control plane on mutual TLS."""
    _require_sglang()
    from sglang_pdd.launcher.cluster import LocalCluster
    from sglang_pdd.launcher.topology import Topology

    topology = Topology.on_free_ports(intra_dc_transport=intra_dc_transport, prefill_tp=prefill_tp, main_tp=main_tp)
    topology.wan.rate_gbps, topology.wan.latency_ms = TEST_WAN_GBPS, 20.0
    if control_tls is not None:
        topology.use_control_tls(control_tls)
    # P keeps KV for a late WAN destination longer than the 2 s default: a loaded CI machine
    # can take that long between P's prefill and the router's POST.
    topology.prefill.extra_args += ["--pdd-wan-destination-wait-ms", str(TEST_DESTINATION_WAIT_MS)]
    # take-overs at a chosen token (support/takeover.py): RLD holds itself when a test arms it
    from sglang_pdd.sglang_glue.relay.relay_hold import RELAY_HOLD_FILE_ENV
    topology.relay.extra_env[RELAY_HOLD_FILE_ENV] = str(run_root / name / "relay_hold")
    for server in topology.servers:
        server.extra_args += list(extra_args)
        if page_size != 1:  # the last --page-size wins over the launcher's default
            server.extra_args += ["--page-size", str(page_size)]
    with LocalCluster(run_root / name, model_path=model_path, topology=topology,
                      router_args=TEST_ROUTER_ARGS) as cluster:
        warm_up(cluster)
        yield cluster


@pytest.fixture(scope="module")
def pdd_cluster(run_root, servers_under_test):
    """P + RLD + MD + WAN emulator + router, as real processes (shared by every module that
    asks for this configuration)."""
    return servers_under_test.get("cluster", lambda: start_pdd_cluster(run_root))


@pytest.fixture(scope="module", params=[16], ids=lambda n: f"page{n}")
def pdd_cluster_paged(run_root, servers_under_test, request):
    """The same topology with ``--page-size N`` on P, RLD and MD."""
    cluster = servers_under_test.get(f"cluster-page{request.param}",
                                     lambda: start_pdd_cluster(run_root, f"cluster-page{request.param}",
                                                               page_size=request.param))
    cluster.page_size = request.param
    return cluster


def _run_group(item, on_default: set) -> int:
    """Run order: the demo (its own processes, nothing else alive), then every module on the
    shared default cluster, then the others, each with its own servers."""
    if item.module.__name__.rpartition(".")[2] == "test_e2e_demo":
        return 0
    return 1 if item.module in on_default else 2


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # after pytest's own fixture-scope ordering; a stable sort keeps it within each group
    on_default = {item.module for item in items if "pdd_cluster" in item.fixturenames}
    items.sort(key=lambda item: _run_group(item, on_default) if item.get_closest_marker("e2e") else -1)


@pytest.fixture(scope="session")
def router_sglang_state():
    """The router's SGLang serving state (tokenizer, model config, chatml template) for the tiny
    model, built in-process as the router builds it: HTTP-front tests without servers."""
    model = _require_sglang()
    from sglang_pdd.router.front.serving import build_sglang_state

    return build_sglang_state(["--model-path", model, "--device", "cpu", "--chat-template", "chatml"])


@contextlib.contextmanager
def on_consecutive_ports(n: int, first, at_port, port_of):
    """n servers on consecutive ports, as TP ranks listen (rank r on rank 0's port + r):
    ``first()`` binds rank 0 anywhere, ``at_port(rank, port)`` binds the others, ``port_of(server)``
    reads rank 0's port; a taken port means another base. Yields the list, closes them all."""
    for _ in range(50):
        servers = [first()]
        try:
            for rank in range(1, n):
                servers.append(at_port(rank, port_of(servers[0]) + rank))
            break
        except OSError:  # port + r taken by someone else: try another base port
            for server in servers:
                server.close()
    else:
        raise RuntimeError(f"no {n} consecutive free ports")
    try:
        yield servers
    finally:
        for server in servers:
            server.close()
