"""End-to-end PDD with ``--page-size 16`` on P, RLD and MD: greedy output_ids through P->MD and
P->RLD->MD equal a plain single server's, MD's cached prefix is page-aligned, and P sends only
from that page boundary on."""

import pytest

from sglang_pdd.launcher.http import post_json
from tests.support.pdd_requests import PROMPTS, assert_routes_equal_reference, assert_second_turn_sends_only_the_suffix, greedy_body

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster]


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
    page = pdd_cluster_paged.page_size
    turn1_tokens, cached = assert_second_turn_sends_only_the_suffix(
        pdd_cluster_paged, "def parse(config):\n    values = {}\n    for key in config:\n        values[key] = config[key]\n",
        lambda prompt: post_json(f"{single_server}/generate", greedy_body(prompt))["output_ids"])
    assert cached % page == 0 and cached >= turn1_tokens // page * page - page and cached > 0
