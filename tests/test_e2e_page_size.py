"""End-to-end PDD with ``--page-size 16`` on P, RLD and MD: greedy output_ids through P->MD and
P->RLD->MD equal a plain single server's, MD's cached prefix is page-aligned, and P sends only
from that page boundary on."""

import pytest

from sglang_pdd.launcher.http import get_json, post_json
from test_e2e_pdd import PROMPTS, assert_routes_equal_reference, greedy_body, route

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def reference(single_server):
    return {p: post_json(f"{single_server}/generate", greedy_body(p))["output_ids"] for p in PROMPTS}


@pytest.mark.parametrize("options", [{"path": "p_md"}, {"path": "p_rld_md", "handoff_mode": "one_shot"}],
                         ids=lambda o: o["path"])
def test_paged_output_ids_equal_single_server(pdd_cluster_paged, reference, options):
    def page_aligned(pdd):
        assert pdd["md_cached_tokens"] % pdd_cluster_paged.page_size == 0

    assert_routes_equal_reference(pdd_cluster_paged, reference, options, check=page_aligned)


def test_paged_drc_second_turn_sends_from_the_page_boundary(pdd_cluster_paged, single_server):
    control, page = pdd_cluster_paged.topology.main.control_url, pdd_cluster_paged.page_size
    turn1 = "def parse(config):\n    values = {}\n    for key in config:\n        values[key] = config[key]\n"
    first = route(pdd_cluster_paged, turn1, path="p_md")
    turn2 = turn1 + first["text"] + "\n# next turn\n"
    key = pdd_cluster_paged.control_key  # MD's control API answers signed calls only
    before = get_json(f"{control}/pdd/stats", key=key)
    second = route(pdd_cluster_paged, turn2, path="p_md")
    after = get_json(f"{control}/pdd/stats", key=key)
    assert second["output_ids"] == post_json(f"{single_server}/generate", greedy_body(turn2))["output_ids"]
    cached = second["meta_info"]["pdd"]["md_cached_tokens"]
    assert cached % page == 0 and cached >= first["meta_info"]["prompt_tokens"] // page * page - page
    assert cached > 0
    assert after["wan_tokens"] - before["wan_tokens"] == second["meta_info"]["prompt_tokens"] - cached
    assert after["rooms_failed"] == before["rooms_failed"]
