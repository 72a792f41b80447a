"""A hybrid sliding-window model (tiny Mellum style, artifacts/tiny-mellum: layers sliding/full/
sliding/full, window 32) on real SGLang: SGLang gives it an SWAKVPool, the sliding layers in a
pool smaller than the full one.

The plain-server test is the real-server repro of patches/sglang-0003: with the SWA pool at 2%
of the full pool, a dozen sequential prompts push the full-pool indices past the SWA pool's
size; unpatched, torch_native reads an SWA layer with those indices and the scheduler dies
(IndexError). Its greedy output_ids are checked against transformers' own generate.
"""

import random
import re

import pytest

from sglang_pdd.launcher.http import post_json
from tests.conftest import _require_sglang, plain_server

pytestmark = [pytest.mark.e2e, pytest.mark.full, pytest.mark.own_cluster]

NEW_TOKENS = 8


def _swa_model():
    _require_sglang()
    from sglang_pdd.launcher.cluster import default_swa_model_path

    return default_swa_model_path()


@pytest.fixture(scope="module")
def swa_model():
    return _swa_model()


def random_prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def transformers_greedy(model_path: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 min_new_tokens=new_tokens)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def test_small_swa_pool_serves_sequential_prompts_past_its_size(run_root, swa_model, servers_under_test):
    servers_under_test.stop()
    prompts = random_prompts(12, 100, 210)
    # 65536 full slots, 1310 SWA slots: the radix cache keeps every prompt, so full-pool indices
    # pass the SWA pool's size by the 8th prompt while the SWA pool frees what leaves the window
    args = ("--dtype", "float32", "--swa-full-tokens-ratio", "0.02")
    with plain_server(run_root, swa_model, name="single-swa-small", extra_args=args) as url:
        got = [post_json(f"{url}/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}, timeout=300)["output_ids"]
               for ids in prompts]
        log = (run_root / "single-swa-small-logs" / "single-swa-small.log").read_text(errors="replace")
    swa_size = int(re.search(r"swa size: (\d+)", log).group(1))
    assert swa_size < sum(len(p) + NEW_TOKENS for p in prompts)  # the run passes the SWA pool's size
    assert got == transformers_greedy(swa_model, prompts, NEW_TOKENS)


@pytest.mark.parametrize("role", ["main", "prefill"])
def test_pdd_roles_refuse_the_hybrid_pool_at_start_naming_it(run_root, swa_model, servers_under_test, role):
    """PDD's WAN channel does not move hybrid pools yet: P and MD stop before serving, saying
    which pool (sglang_glue/servable.py), instead of failing at a request."""
    from sglang_pdd.launcher.processes import ProcessFailed, ProcessGroup
    from sglang_pdd.launcher.topology import Topology, server_argv, server_env, write_wan_key

    servers_under_test.stop()
    topology = Topology.on_free_ports()
    spec = topology.main if role == "main" else topology.prefill
    key = write_wan_key(run_root / f"refuse-{role}.key")
    with ProcessGroup(run_root / f"refuse-{role}-logs") as procs:
        procs.start(spec.name, server_argv(spec, swa_model, str(key)) + ["--dtype", "float32"],
                    health_url=f"{spec.url}/health", env=server_env(spec))
        with pytest.raises(ProcessFailed) as failed:
            procs.wait_healthy(timeout_s=600)
    assert "exited with code" in str(failed.value)
    log = (run_root / f"refuse-{role}-logs" / f"{spec.name}.log").read_text(errors="replace")
    assert "sglang-pdd cannot move this model's KV yet: its SWAKVPool is a hybrid pool" in log
