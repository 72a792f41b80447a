"""The README's first command, the project's main job: ``bash scripts/demo.sh`` sets up, starts
P + RLD + MD + router across the emulated WAN, serves an agent session and prints what happened
to each turn. Run here as a user runs it (two turns), its table checked: paths, MD's prefix hit,
the handoff, the DRC summary line."""

from __future__ import annotations

import json
import subprocess

import pytest

from sglang_pdd.launcher.demo import MAX_NEW_TOKENS
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def demo(tmp_path_factory, servers_under_test):
    servers_under_test.stop()  # the demo starts its own servers: nothing else on the cores
    run_dir = tmp_path_factory.mktemp("demo")
    summary = run_dir / "summary.json"
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "demo.sh"), "--turns", "2", "--run-dir", str(run_dir),
                           "--summary-json", str(summary)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=900)
    return done, (json.loads(summary.read_text()) if summary.exists() else None)


def test_demo_exits_cleanly_with_its_table(demo):
    done, summary = demo
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["turn", "path", "prompt"])
    rows = [line.split() for line in lines[header + 1:header + 3]]
    assert [row[0] for row in rows] == ["1", "2"], lines[header:]
    assert any(line.startswith("MD's DRC: hit rate ") for line in lines), lines[-5:]
    assert summary is not None and len(summary["turns"]) == 2
    for row, pdd in zip(rows, summary["turns"]):  # the printed table is the summary's
        assert row[1:4] == [pdd["path"], str(pdd["prompt_tokens"]), str(pdd["md_cached_tokens"])]


def test_demo_session_hands_off_and_hits_mds_cache(demo):
    _, summary = demo
    first, second = summary["turns"]
    # turn 1: nothing cached on MD, its whole prompt crosses the slow WAN: P->RLD->MD, RLD
    # streams eager tokens and MD continues after a handoff
    assert first["path"] == "p_rld_md" and first["md_cached_tokens"] == 0, first
    # turn 2 extends turn 1: MD holds at least turn 1's prompt
    assert second["md_cached_tokens"] >= first["prompt_tokens"], second
    for pdd in (first, second):
        assert not pdd["fallbacks"], pdd
        assert pdd["rld_tokens"] + pdd["md_tokens"] == MAX_NEW_TOKENS, pdd
        # MD took over, or RLD finished before MD's KV landed (a fast RLD on a short first turn)
        # and the KV still went on to MD for the next turn: never neither
        handed_off = pdd["handoff_at"] is not None and pdd["md_tokens"] > 0
        assert handed_off or (pdd["md_tokens"] == 0 and pdd["md_kv_kept"]), pdd
    # the longer second turn's KV takes longer than RLD's 512 tokens on any machine seen
    assert any(pdd["handoff_at"] is not None for pdd in (first, second)), summary["turns"]
    drc = summary["drc"]
    assert drc["hit_rate"] > 0 and drc["bytes_saved"] > 0 and drc["rooms_failed"] == 0, drc
