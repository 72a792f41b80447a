"""The benchmarks that start real SGLang servers (or the router process) run here at their
smallest honest size, each its documented command: rc 0 and their figures printed or written.
Not their values: timing goals stay in the benchmarks. The cheap ones run in the unit tier
(tests/unit/benchmarks/test_bench_smoke.py); tests/unit/repo/test_bench_smoke_coverage.py
keeps the list of entry points complete."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, _require_sglang

# Each starts its own servers (a cluster, a plain server, or the router against fakes) or
# takes most of a minute: the full tier's shard of own configurations.
pytestmark = [pytest.mark.e2e, pytest.mark.full, pytest.mark.own_cluster]


def _run(name: str, argv: list[str], timeout_s: float = 1200) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *argv], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture
def own_cores(servers_under_test):
    """The shared cluster stopped: each benchmark brings its own servers."""
    _require_sglang()
    servers_under_test.stop()


# (argv with {out} for a temporary folder, what stdout must show, files written under {out})
SMOKE = {
    # the quick look's shape, one handoff and one latency: (a) through the emulator in front of MD
    "bench_handoff": (["--n", "2", "--ttft-requests", "1", "--latencies-ms", "5", "--out", "{out}"],
                      ["Handoff latency", "TTFT"], ["results.json", "bench_handoff.png"]),
    "bench_agentic": (["--sessions", "2", "--turns", "2", "3", "--outliers", "1", "--out", "{out}"],
                      ["WAN"], ["results.json"]),
    "bench_router_overhead": (["--requests", "1", "--rounds", "1", "--max-new-tokens", "4", "--out", "{out}"],
                              ["router overhead", "front-end CPU n/a"], ["results.json"]),
    "bench_sim_calibration": (["--n", "10", "--loads", "0.5", "--out", "{out}"], ["wrote"],
                              ["calibration.json", "calibration.png"]),
    # no servers, but ~45 s each on two busy cores: the router's serving stack imported, MD's
    # runtime on SGLang's pools in process
    "bench_control_tls": (["--seconds", "0.05", "--rounds", "1", "--events", "8", "--prompt-tokens", "64"],
                          ["new connection", "handoff stream (8 ev)"], []),
    "bench_md_ingest": (["--in-process", "--room-tokens", "2048", "--rooms", "1", "--decode-tokens", "200",
                         "--baseline-s", "0.5", "--gap-s", "0.2", "--pool-tokens", "16384", "--staging-mb", "64",
                         "--out", "{out}"], ["pool", "md_complete_ms_max"], ["results-in-process.json"]),
    "bench_router_cpu": (["--requests", "2", "--rounds", "1", "--max-new", "8", "--short-new", "4",
                          "--concurrency", "2", "--out", "{out}/results.json"],
                         ["marginal CPU per 1k tokens", "n/a: fewer than"], ["results.json"]),
    "bench_router_long_stream_memory": (["--cases", "20x1", "--top", "2", "--paths", "p_md", "--out",
                                         "{out}/results.json"], ["p_md"], ["results.json"]),
}


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_smoke_run(name, own_cores, tmp_path):
    argv, shows, writes = SMOKE[name]
    done = _run(name, [a.replace("{out}", str(tmp_path)) for a in argv])
    for text in shows:
        assert text in done.stdout + done.stderr, (name, text, done.stdout[-2000:])
    for file in writes:
        assert (tmp_path / file).stat().st_size > 0, (name, file)
    for written in tmp_path.glob("*.json"):
        json.loads(written.read_text())


def test_calibrate_profile_on_a_plain_server(own_cores, tmp_path):
    """calibrate_profile against one plain SGLang server at tiny lengths: it reads the model's
    vocabulary (1024 ids) from its config, so the server it measures stays up."""
    from sglang_pdd.launcher.cluster import default_model_path
    from sglang_pdd.launcher.processes import ProcessGroup
    from sglang_pdd.launcher.topology import CPU_ENV, ServerSpec, free_port, server_argv

    spec = ServerSpec("plain", None, free_port())
    out = tmp_path / "tiny.json"
    with ProcessGroup(tmp_path / "logs") as group:
        group.start("plain", server_argv(spec, default_model_path()), health_url=f"{spec.url}/health", env=CPU_ENV)
        group.wait_healthy(timeout_s=600)
        _run("calibrate_profile", ["--prefill-url", spec.url, "--name", "tiny", "--price-per-chip-hour", "1",
                                   "--prefill-lengths", "16,32,64", "--decode-batches", "1,2,3",
                                   "--decode-prompt", "16", "--decode-tokens", "4", "--out", str(out)])
        assert group.procs["plain"].popen.poll() is None  # the server it measured is still up
    profile = json.loads(out.read_text())
    assert profile["name"] == "tiny" and profile["kv_bytes_per_token"] > 0
    assert len(profile["_samples"]["prefill"]) == 3 and len(profile["_samples"]["decode"]) == 3

