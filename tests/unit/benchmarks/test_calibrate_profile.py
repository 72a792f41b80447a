"""calibrate_profile takes the vocabulary and KV shape from the served model's config (SGLang's
HTTP API reports neither): never a guessed vocabulary, whose ids past the model's crash the
server it measures."""

from __future__ import annotations

import json

import pytest

from benchmarks import calibrate_profile as cp
from tests.conftest import REPO_ROOT

TINY = REPO_ROOT / "artifacts" / "tiny-llama"


def test_the_config_comes_from_the_model_path_the_server_reports():
    if not (TINY / "config.json").exists():
        pytest.skip("the tiny model is built by scripts/setup.sh")
    cfg = cp.served_model_config(str(TINY))
    assert cfg["vocab_size"] == json.loads((TINY / "config.json").read_text())["vocab_size"]


def test_model_config_overrides_and_takes_a_file_or_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 77, "text_config": {"num_hidden_layers": 3}}))
    for override in (tmp_path, tmp_path / "config.json"):
        cfg = cp.served_model_config("/nowhere/model", str(override))
        assert cfg["vocab_size"] == 77 and cfg["num_hidden_layers"] == 3  # a multimodal model's text part


def test_an_unreadable_config_names_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--model-config"):
        cp.served_model_config(str(tmp_path / "missing-model"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="no vocab_size"):
        cp.served_model_config(str(tmp_path))


def test_kv_dtype_is_the_servers_or_the_models():
    assert cp.kv_dtype({"kv_cache_dtype": "fp8_e4m3", "dtype": "bfloat16"}, {}) == "fp8_e4m3"
    assert cp.kv_dtype({"kv_cache_dtype": "auto", "dtype": "auto"}, {"torch_dtype": "float32"}) == "float32"
    assert cp.kv_dtype({}, {}) == "bfloat16"
