"""benchmarks/gpu_dsv4_pool_transfer.py: its CLI, and its run at the smallest honest size on CPU
(the GPU run needs a lent GPU; none has run it)."""

import json

import pytest

from benchmarks import gpu_dsv4_pool_transfer as bench

pytest.importorskip("sglang")


def test_help_names_the_device_and_size_options(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--device" in out and "--requests" in out and "--seq-len" in out


def test_cpu_run_moves_one_request_byte_for_byte(tmp_path):
    out = tmp_path / "rows.json"
    assert bench.main(["--device", "cpu", "--requests", "1", "--seq-len", "700", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["equal"] and row["seq_len"] == 700
    assert set(row["bytes"]) == {"pages", "window", "request"}
    assert row["total_bytes"] < row["without_window_bytes"]  # the window is all the sliding layers send
