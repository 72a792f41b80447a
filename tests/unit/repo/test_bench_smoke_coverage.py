"""Every benchmark entry point (a script in benchmarks/ with a ``__main__``) has a smoke run:
its documented command at the smallest honest size, run by the test named here. A new script
without one fails until it gets one and a line in this table."""

from __future__ import annotations

import ast
import re

import pytest

from tests.conftest import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"
UNIT = "tests/unit/benchmarks/test_bench_smoke.py::test_smoke_run"
E2E = "tests/e2e/test_e2e_bench_smoke.py::test_smoke_run"

# entry point -> the test that runs it (a SMOKE table's key, or a test of its own)
SMOKE_RUNS = {
    "bench_agentic": E2E,
    "bench_control_dos": UNIT,
    "bench_control_reply_sig": UNIT,
    "bench_control_tls": E2E,
    "bench_frame_mac": UNIT,
    "bench_gpu_roofline": UNIT,  # --smoke: CPU, tiny shapes
    "bench_handoff": E2E,
    "bench_md_ingest": E2E,  # --in-process
    "bench_real_pd_vs_pdd": "tests/e2e/test_e2e_real_pd_vs_pdd.py::quick_run",  # --quick, then four checks on it
    "bench_router_cpu": E2E,
    "bench_router_long_stream_memory": E2E,
    "bench_router_overhead": E2E,
    "bench_router_reply_bounds": UNIT,
    "bench_sim_calibration": E2E,
    "bench_sim_speed": UNIT,
    "bench_wan_channel": UNIT,
    "calibrate_profile": "tests/e2e/test_e2e_bench_smoke.py::test_calibrate_profile_on_a_plain_server",
    "gpu_dsv4_pool_transfer": "tests/unit/benchmarks/test_gpu_dsv4_pool_transfer.py::test_cpu_run_moves_one_request_byte_for_byte",
    "gpu_pdd_backend": UNIT,  # GPU only: --help
    "sim_compare": UNIT,
    "sim_digest": UNIT,
    "sim_path_modes": UNIT,
    "sim_report": UNIT,
    "sim_headline": UNIT,
}


def entry_points() -> set[str]:
    return {p.stem for p in BENCHMARKS.glob("*.py")
            if re.search(r'^if __name__ == "__main__":', p.read_text(), re.MULTILINE)}


def smoke_keys(tree: ast.Module) -> set[str]:
    """The scripts a module's ``SMOKE`` table runs (keys ``name`` or ``name:variant``)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SMOKE" for t in node.targets):
            return {k.value.split(":")[0] for k in node.value.keys}
    return set()


def test_every_entry_point_has_a_smoke_run():
    found = entry_points()
    assert len(found) >= 20
    assert not found - set(SMOKE_RUNS), f"benchmarks without a smoke run (add one and a line here): {found - set(SMOKE_RUNS)}"
    assert not set(SMOKE_RUNS) - found, f"no such entry point any more: {set(SMOKE_RUNS) - found}"


@pytest.mark.parametrize("name", sorted(SMOKE_RUNS))
def test_the_named_test_runs_the_entry_point(name):
    path, function = SMOKE_RUNS[name].split("::")
    text = (REPO_ROOT / path).read_text()
    tree = ast.parse(text)
    assert function in {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}, path
    if function == "test_smoke_run":
        assert name in smoke_keys(tree), f"{path}'s SMOKE table has no {name}"
    else:
        runs = (f"benchmarks.{name}", f'"{name}"', f"from benchmarks import {name}")
        assert any(r in text for r in runs), f"{path}::{function} does not run {name}"


def test_entry_points_reads_main_guards(tmp_path):
    assert "sim_headline" in entry_points() and "common" not in entry_points()
