"""Each cheap benchmark (no SGLang server, seconds each) runs its documented command at the smallest
honest size: rc 0 and its figures printed or written (not their values: timing goals stay in
the benchmarks). The ones with servers run in tests/e2e/test_e2e_bench_smoke.py;
tests/unit/repo/test_bench_smoke_coverage.py keeps the list of entry points complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

# name -> (argv, with {out} for a temporary folder and {trace} for a small Mooncake-format
# trace; what stdout must show; files written under {out}). Several commands per script are
# listed as "name" and "name:variant".
SMOKE = {
    "bench_control_reply_sig": (["--seconds", "0.05", "--rounds", "1", "--events", "8", "--prompt-tokens", "64"],
                                ["handoff stream (8 ev) ms", "HMAC alone"], []),
    "bench_control_dos": (["--scenario", "starvation-md", "--calls", "5"], ["starvation-md"], []),
    "bench_frame_mac": (["--mb", "1", "--frames-kib", "256", "--repeats", "1", "--threads", "2",
                         "--schemes", "aes-gmac,hmac-sha256"], ["frame 256 KiB", "aes-gmac"], []),
    "bench_frame_mac:hot": (["--mb", "1", "--frames-kib", "1024", "--repeats", "1", "--hot", "--schemes", "aes-gmac"],
                            ["(one frame, hot)", "aes-gmac"], []),
    # 1 MiB: the smallest --sizes-mb (an integer), once past the registered-memory crash
    "bench_wan_channel": (["--rates-gbps", "1", "--sizes-mb", "1", "--loopback-sizes-mb", "1", "--repeats", "1",
                           "--out", "{out}"], ["Emulated WAN", "Loopback"], ["results.json", "bench_wan.png"]),
    "bench_wan_channel:side-by-side": (["--side-by-side", "--loopback-sizes-mb", "1", "--repeats", "1", "--tls",
                                        "both", "--out", "{out}"], ["sendall"], []),
    "bench_sim_speed": (["--n", "200"], ["events"], []),
    "bench_sim_speed:trace": (["--trace", "{trace}", "--designs", "all", "--arrivals", "open"], ["events"], []),
    "sim_compare": (["--trace", "{trace}", "--agentic", "100", "--out", "{out}"], ["SLA"], []),
    "sim_digest": (["--n", "30"], ["digest"], []),
    "sim_path_modes": (["--quick", "--n", "100", "--out", "{out}"], ["agentic"], []),
    "sim_report": (["--traces", "agentic", "--n", "100", "--prefill-max", "2", "--rld-max", "1", "--md-max", "2",
                    "--scales", "1", "--out", "{out}"], [], []),
    "sim_headline": (["staging", "--n", "60", "--tile", "1", "--shares", "0.25", "--out", "{out}"], [], []),
    "bench_router_reply_bounds": (["--reply-mib", "4", "--line-mib", "4", "--timeout-s", "30"], ["register"], []),
    # GPU only: imported and its options printed
    "gpu_pdd_backend": (["--help"], ["--arch"], []),
    "bench_gpu_roofline": (["--smoke", "--json", "{out}/roofline.json"], [], ["roofline.json"]),
}


def small_trace(path: Path, n: int = 60) -> Path:
    """``n`` requests in the Mooncake trace's format (timestamp ms, lengths, 512-token block
    ids, shared prefixes), so no run here needs the downloaded trace."""
    with path.open("w") as f:
        for i in range(n):
            blocks = 1 + i % 6
            f.write(json.dumps({"timestamp": 500 * i, "input_length": 512 * blocks - 17, "output_length": 32 + i % 50,
                                "hash_ids": [j if j < 2 else 1000 * i + j for j in range(blocks)]}) + "\n")
    return path


def run(name: str, argv: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


@pytest.mark.parametrize("case", sorted(SMOKE))
def test_smoke_run(case, tmp_path):
    argv, shows, writes = SMOKE[case]
    trace = small_trace(tmp_path / "trace.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    done = run(case.split(":")[0], [a.replace("{out}", str(out)).replace("{trace}", str(trace)) for a in argv])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for text in shows:
        assert text in done.stdout, (case, text, done.stdout[-2000:])
    for file in writes:
        assert (out / file).stat().st_size > 0, (case, file)


def test_a_missing_trace_is_named_with_where_to_get_it(tmp_path):
    done = run("sim_compare", ["--trace", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)])
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "none.jsonl" in done.stderr and "kvcache-ai/Mooncake" in done.stderr and "--trace PATH" in done.stderr


def test_a_frame_larger_than_the_data_is_refused():
    done = run("bench_frame_mac", ["--mb", "1", "--frames-kib", "256,4096"])
    assert done.returncode == 2 and "--frames-kib 4096: a frame larger than the --mb 1 MiB" in done.stderr
