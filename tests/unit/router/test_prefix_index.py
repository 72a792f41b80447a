import ast
import subprocess
import sys

import pytest

from sglang_pdd.router.backends.placement import InstanceLoad
from sglang_pdd.router.backends.prefix_index import PrefixIndex, block_hashes
from tests.conftest import REPO_ROOT

B = 4  # small blocks keep the tables readable


def toks(n, start=0):
    return list(range(start, start + n))


# ---- block_hashes ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "n, blocks",
    [(0, 0), (1, 0), (3, 0), (4, 1), (7, 1), (8, 2), (13, 3), (64, 16)],
)
def test_block_hashes_count_only_full_blocks(n, blocks):
    assert len(block_hashes(toks(n), B)) == blocks


def test_block_hashes_chain_depends_on_all_previous_blocks():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], B)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], B)  # same second block, different first
    assert a[0] != b[0]
    assert a[1] != b[1]  # block 1 differs because its prefix differs
    # A shared prefix gives shared leading hashes.
    c = block_hashes([1, 2, 3, 4, 0, 0, 0, 0], B)
    assert c[0] == a[0] and c[1] != a[1]


def test_block_hashes_are_deterministic_across_processes():
    # Python's hash() is salted per process; ours must not be.
    code = "from sglang_pdd.router.backends.prefix_index import block_hashes; print(block_hashes(list(range(256)), 64))"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd=REPO_ROOT, env={"PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    assert ast.literal_eval(outs.pop()) == block_hashes(list(range(256)), 64)


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**64, 0, 0, 0], [1.5, 0, 0, 0]])
def test_block_hashes_reject_bad_token_ids(bad):
    with pytest.raises(ValueError):
        block_hashes(bad, B)


def test_block_hashes_reject_bad_block_size():
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)


def test_default_block_size_is_64():
    assert len(block_hashes(toks(130))) == 2
    assert PrefixIndex(10).block_tokens == 64


# ---- block-hash core (what the simulator uses: trace hash ids, no tokens) ------------------

def test_blocks_longest_holder_wins_and_chain_breaks_at_first_unknown():
    idx = PrefixIndex(capacity_blocks_per_instance=4, block_tokens=B)
    idx.record_blocks("md0", [1, 2])
    idx.record_blocks("md1", [1, 2, 3])  # md1 holds the longer prefix
    assert idx.best_blocks(["md0", "md1"], [1, 2, 3, 9]) == ("md1", 3)
    assert idx.best_blocks(["md0", "md1"], [1, 2]) == ("md0", 2)  # tie -> first
    assert idx.match_blocks("md0", [1, 2, 3]) == 2
    assert idx.match_blocks("md1", [7, 1]) == 0  # chain breaks at the first unknown block
    assert idx.best_blocks(["md1", "md0"], [7, 1]) == ("md1", 0)  # no hit -> first, 0


def test_blocks_lru_bound_is_per_instance():
    idx = PrefixIndex(capacity_blocks_per_instance=4, block_tokens=B)
    idx.record_blocks("md0", [1, 2])
    idx.record_blocks("md1", [1, 2, 3])
    idx.record_blocks("md0", [10, 11, 12])  # 5th block on md0 evicts md0's LRU block (2)
    assert idx.stats()["blocks_per_instance"] == {"md0": 4, "md1": 3}
    assert idx.stats()["evicted_blocks"] == 1
    assert idx.match_blocks("md0", [1, 2, 3]) == 1
    assert idx.match_blocks("md1", [1, 2, 3]) == 3  # md1 untouched
    assert idx.best_blocks(["md0", "md1"], [10, 11, 12]) == ("md0", 3)


def test_best_blocks_does_not_trust_a_deep_block_without_its_root():
    # best_blocks first checks the block that would beat the current best; an instance
    # that has it but lacks an earlier block must still be walked from block 0.
    idx = PrefixIndex(100, B)
    idx.record_blocks("a", [1, 2])
    idx.record_blocks("b", [9, 2, 3])  # holds 2 and 3 but not 1
    for order in (["a", "b"], ["b", "a"]):
        assert idx.best_blocks(order, [1, 2, 3]) == ("a", 2)
    idx.record_blocks("c", [1, 2, 3])
    assert idx.best_blocks(["a", "b", "c"], [1, 2, 3]) == ("c", 3)


def test_best_blocks_edge_cases():
    idx = PrefixIndex(100, B)
    idx.record_blocks("a", ["x", "y"])  # any hashable is a block hash
    idx.record_blocks("b", [])  # counted as a record, stores nothing
    assert idx.best_blocks(["b", "a"], []) == ("b", 0)
    assert idx.best_blocks(["b", "a"], ["x", "y"]) == ("a", 2)
    assert idx.best_blocks(["zz", "a"], ["x"]) == ("a", 1)  # unknown instance: no hit
    assert idx.stats()["records"] == 2 and idx.stats()["instances"] == 1
    with pytest.raises(ValueError):
        idx.best_blocks([], ["x"])


def test_token_methods_are_the_block_methods_on_block_hashes():
    by_tokens, by_blocks = PrefixIndex(100, B), PrefixIndex(100, B)
    prompts = [PROMPT, PROMPT[:8] + toks(8, 300), toks(13, 700)]
    for i, p in enumerate(prompts):
        by_tokens.record(f"i{i % 2}", p)
        by_blocks.record_blocks(f"i{i % 2}", block_hashes(p, B))
    assert by_tokens.stats() == by_blocks.stats()
    assert by_tokens._blocks == by_blocks._blocks
    for q in prompts + [PROMPT[:10], toks(20, 5000)]:
        h = block_hashes(q, B)
        for inst in ("i0", "i1", "i2"):
            assert by_tokens.match(inst, q) == by_blocks.match_blocks(inst, h) * B
        inst, blocks = by_blocks.best_blocks(["i2", "i1", "i0"], h)
        assert by_tokens.best(["i2", "i1", "i0"], q) == (inst, blocks * B)


def test_simulator_affinity_prefers_the_least_loaded_of_equal_holders():
    from sglang_pdd.sim.cluster import Simulation

    idx = PrefixIndex(100, B)
    idx.record_blocks(0, [1, 2])
    idx.record_blocks(1, [1, 2])  # a shared system prompt: both hold it
    idx.record_blocks(2, [1, 2, 3])
    loads = [InstanceLoad(0, 0.5), InstanceLoad(1, 0.1), InstanceLoad(2, 0.9)]
    assert Simulation._affinity(idx, [0, 1, 2], loads, [1, 2, 5]) == 1  # tie: least loaded
    assert Simulation._affinity(idx, [0, 1, 2], loads, [1, 2, 3]) == 2  # longest match wins
    assert Simulation._affinity(idx, [0, 1, 2], loads, [7]) is None  # no holder: no affinity
    even = [InstanceLoad(i, 0.0) for i in range(3)]
    assert Simulation._affinity(idx, [0, 1, 2], even, [1, 2]) == 0  # equal loads: index order


# ---- match ----------------------------------------------------------------------------

PROMPT = toks(16)  # 4 full blocks


@pytest.mark.parametrize(
    "query, expected",
    [
        (PROMPT, 16),                       # identical
        (PROMPT[:12], 12),                  # shorter prefix of what is cached
        (PROMPT[:13], 12),                  # partial last block ignored
        (PROMPT[:3], 0),                    # not even one full block
        ([], 0),
        (PROMPT + toks(8, 100), 16),        # longer prompt: the cached part only
        (PROMPT[:9] + [999] + PROMPT[10:], 8),  # divergence in block 2 -> blocks 0,1 only
        ([999] + PROMPT[1:], 0),            # divergence in block 0 -> nothing
        (PROMPT[:15] + [999], 12),          # divergence in the last token of the last block
        (toks(16, 1000), 0),                # unrelated prompt
    ],
)
def test_match_table(query, expected):
    idx = PrefixIndex(capacity_blocks_per_instance=100, block_tokens=B)
    idx.record("p0", PROMPT)
    assert idx.match("p0", query) == expected


def test_match_unknown_instance_is_zero():
    idx = PrefixIndex(100, B)
    idx.record("p0", PROMPT)
    assert idx.match("p1", PROMPT) == 0


def test_match_branching_prompts_share_their_prefix():
    idx = PrefixIndex(100, B)
    idx.record("p0", toks(8) + [50, 51, 52, 53])
    idx.record("p0", toks(8) + [60, 61, 62, 63])
    assert idx.match("p0", toks(8) + [50, 51, 52, 53]) == 12
    assert idx.match("p0", toks(8) + [60, 61, 62, 63]) == 12
    assert idx.match("p0", toks(8) + [70, 71, 72, 73]) == 8
    assert idx.stats()["blocks"] == 4  # the shared two blocks are stored once


def test_match_does_not_mutate():
    idx = PrefixIndex(100, B)
    idx.record("p0", PROMPT)
    before = idx.stats()
    idx.match("p0", PROMPT)
    idx.best(["p0", "p1"], PROMPT)
    assert idx.stats() == before


# ---- best / multi-instance -------------------------------------------------------------

@pytest.mark.parametrize(
    "instances, expected",
    [
        (["a", "b", "c"], ("b", 12)),
        (["c", "a", "b"], ("b", 12)),
        (["a", "c"], ("a", 4)),
        (["c", "d"], ("c", 0)),       # no hit anywhere -> first, 0
        (["d", "c"], ("d", 0)),
    ],
)
def test_best_table(instances, expected):
    idx = PrefixIndex(100, B)
    idx.record("a", PROMPT[:4])
    idx.record("b", PROMPT[:12])
    idx.record("e", PROMPT)  # not offered -> never chosen
    assert idx.best(instances, PROMPT) == expected


def test_best_ties_go_to_first():
    idx = PrefixIndex(100, B)
    idx.record("a", PROMPT)
    idx.record("b", PROMPT)
    assert idx.best(["b", "a"], PROMPT) == ("b", 16)
    assert idx.best(["a", "b"], PROMPT) == ("a", 16)


def test_best_needs_instances():
    with pytest.raises(ValueError):
        PrefixIndex(100, B).best([], PROMPT)


def test_instances_are_independent():
    idx = PrefixIndex(4, B)
    idx.record("a", PROMPT)
    idx.record("b", toks(16, 500))
    assert idx.match("a", PROMPT) == 16 and idx.match("b", PROMPT) == 0
    assert idx.match("b", toks(16, 500)) == 16 and idx.match("a", toks(16, 500)) == 0
    # Filling "b" far past capacity does not evict anything from "a".
    for i in range(20):
        idx.record("b", toks(16, 1000 + 100 * i))
    assert idx.match("a", PROMPT) == 16
    assert idx.forget("b") == 4
    assert idx.match("a", PROMPT) == 16 and idx.match("b", toks(16, 500)) == 0


def test_forget():
    idx = PrefixIndex(100, B)
    idx.record("a", PROMPT)
    assert idx.forget("a") == 4
    assert idx.match("a", PROMPT) == 0
    assert idx.forget("a") == 0  # idempotent
    assert idx.stats()["instances"] == 0


# ---- LRU bound -------------------------------------------------------------------------

@pytest.mark.parametrize("capacity", [1, 3, 4, 10])
def test_memory_bound_respected(capacity):
    idx = PrefixIndex(capacity, B)
    for i in range(50):
        idx.record("a", toks(4 * 5, 1000 * i))  # 5 blocks each
        assert idx.stats()["blocks_per_instance"]["a"] <= capacity
    assert idx.stats()["evicted_blocks"] == 50 * 5 - capacity


@pytest.mark.parametrize("capacity, expected", [(1, 4), (2, 8), (3, 12), (4, 16), (5, 16)])
def test_prompt_longer_than_capacity_keeps_its_leading_blocks(capacity, expected):
    # Tails are evicted before roots, so what remains is still a matchable prefix.
    idx = PrefixIndex(capacity, B)
    idx.record("a", PROMPT)
    assert idx.match("a", PROMPT) == expected


def test_lru_evicts_least_recently_recorded():
    idx = PrefixIndex(4, B)
    old, new = toks(8, 0), toks(8, 100)
    idx.record("a", old)
    idx.record("a", new)
    assert idx.match("a", old) == 8 and idx.match("a", new) == 8
    idx.record("a", old)  # touch old: new is now LRU
    idx.record("a", toks(4, 200))  # one more block -> evict one of new's (its tail)
    assert idx.match("a", old) == 8
    assert idx.match("a", new) == 4
    assert idx.match("a", toks(4, 200)) == 4


def test_eviction_takes_the_chain_tail_first():
    idx = PrefixIndex(3, B)
    idx.record("a", PROMPT[:12])  # blocks 0,1,2; block 2 is least recently used
    idx.record("a", toks(4, 500))  # one more block evicts block 2
    assert idx.match("a", PROMPT[:12]) == 8


def test_a_missing_middle_block_cuts_longer_chains():
    # Through `record` an ancestor is always touched after its descendants, so LRU never
    # drops a middle block first; remove one by hand to check the match still stops there.
    idx = PrefixIndex(100, B)
    idx.record("a", PROMPT)
    del idx._blocks["a"][block_hashes(PROMPT, B)[1]]
    assert idx.match("a", PROMPT) == 4


def test_two_fresh_indexes_agree():
    a, b = PrefixIndex(100, 64), PrefixIndex(100, 64)
    prompt = toks(1000)
    a.record("x", prompt)
    b.record("x", prompt)
    assert a._blocks["x"] == b._blocks["x"]
    assert a.match("x", prompt) == b.match("x", prompt) == 960


@pytest.mark.parametrize("kwargs", [dict(capacity_blocks_per_instance=0),
                                    dict(capacity_blocks_per_instance=10, block_tokens=0)])
def test_constructor_validation(kwargs):
    with pytest.raises(ValueError):
        PrefixIndex(**kwargs)


def test_stats():
    idx = PrefixIndex(3, B)
    idx.record("a", PROMPT)
    idx.record("b", PROMPT[:4])
    idx.record("b", [1, 2])  # no full block: counted as a record, stores nothing
    assert idx.stats() == {
        "block_tokens": B,
        "capacity_blocks_per_instance": 3,
        "instances": 2,
        "blocks": 4,
        "blocks_per_instance": {"a": 3, "b": 1},
        "records": 3,
        "evicted_blocks": 1,
    }


def test_large_prompt_is_fast_enough():
    # A 128k-token prompt is 2k blocks; the router hashes it once per request.
    import time

    idx = PrefixIndex(10_000)
    prompt = toks(128 * 1024)
    t = time.perf_counter()
    idx.record("a", prompt)
    assert idx.best(["b", "a"], prompt) == ("a", 128 * 1024)
    assert time.perf_counter() - t < 2.0
