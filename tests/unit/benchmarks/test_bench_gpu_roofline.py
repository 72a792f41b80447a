"""The H200 roofline check: its shapes are the preset's model, and its code runs (on CPU)."""

import json

from benchmarks import bench_gpu_roofline as bench
from sglang_pdd.sim import hardware as hw


def test_llama_shard_is_the_presets_model_split_by_tp():
    prof = hw.preset(hw.LLAMA3_70B, hw.H200)
    shard = bench.LlamaShard(tp=prof.chips_per_instance)
    # 80 layers of the shard are the chip's share of the weights, less embeddings/LM head
    # (~2 x 128k x 8192 x 2 B over the group).
    per_chip = hw.LLAMA3_70B.weight_bytes_gb * 1e9 / prof.chips_per_instance
    assert 0.95 < 80 * shard.weight_bytes() / per_chip < 1.0
    assert 80 * shard.kv_bytes_per_token() * prof.chips_per_instance == hw.LLAMA3_70B.kv_bytes_per_token


def test_smoke_run_writes_a_row_per_shape(tmp_path):
    out = tmp_path / "rows.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["kind"].split()[1] for r in rows] == ["decode", "decode", "MLA", "prefill"]
    assert all(r["measured_ms"] > 0 and r["sim_ms"] > 0 for r in rows)
