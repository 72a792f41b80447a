"""The router's WAN estimate before MD's first registration answer: each MD's KV size (bytes per
token, and a sliding-window pool's window), asked from its stats at start (learn_md_kv_sizes),
not the policy's 70B-class default."""

from __future__ import annotations

import asyncio
from typing import Optional

import aiohttp
import pytest
from tests.support.control_fakes import KEY, MdControl
from tests.support.fake_backends import closed_port

from sglang_pdd.router.front.app import learn_md_kv_sizes
from sglang_pdd.router.backends.clients import use_control_key
from sglang_pdd.router.backends.pools import Pools
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend
from sglang_pdd.protocol import KvSize
from sglang_pdd.router.policy import PathPolicyConfig


@pytest.fixture
def signed_calls():
    use_control_key(KEY)
    yield
    use_control_key(None)


def learn(mains: list[MainBackend], attempts: int = 3, pools: Optional[Pools] = None) -> Pools:
    pools = pools or Pools([PrefillBackend("http://p:1", 8998)], ["http://rld:1"], mains)

    async def run():
        async with aiohttp.ClientSession() as session:
            await learn_md_kv_sizes(session, mains, pools, attempts=attempts, interval_s=0.01)
    asyncio.run(run())
    return pools


def test_router_takes_mds_kv_size_from_its_stats(signed_calls):
    md = MdControl()
    try:
        main = MainBackend(url="http://127.0.0.1:1", control_url=md.url, wan_peer="127.0.0.1:2")
        pools = learn([main])
        assert pools.md_kv_sizes[main.url] == KvSize(md.runtime.kv_bytes_per_token)
        assert md.runtime.kv_bytes_per_token != PathPolicyConfig().kv_bytes_per_token
    finally:
        md.close()


def test_router_takes_a_sliding_window_mds_window_from_its_stats(signed_calls):
    md = MdControl()
    md.runtime.kv_window = {"kv_window_tokens": 31, "kv_window_bytes_per_token": 1024}
    try:
        main = MainBackend(url="http://127.0.0.1:1", control_url=md.url, wan_peer="127.0.0.1:2")
        pools = learn([main])
        assert pools.md_kv_sizes[main.url] == KvSize(md.runtime.kv_bytes_per_token, 31, 1024)
    finally:
        md.close()


def test_a_registration_answer_already_taken_is_kept(signed_calls):
    md = MdControl()
    try:
        main = MainBackend(url="http://127.0.0.1:1", control_url=md.url, wan_peer="127.0.0.1:2")
        pools = Pools([PrefillBackend("http://p:1", 8998)], ["http://rld:1"], [main])
        pools.learn_md_kv_size(main.url, KvSize(2048))  # a registration's answer came first
        learn([main], pools=pools)
        assert pools.md_kv_sizes[main.url] == KvSize(2048)
    finally:
        md.close()


def test_an_md_that_never_answers_keeps_the_default_and_is_given_up(signed_calls):
    main = MainBackend(url="http://127.0.0.1:1", control_url=f"http://127.0.0.1:{closed_port()}",
                       wan_peer="127.0.0.1:2")
    pools = learn([main], attempts=2)
    assert main.url not in pools.md_kv_sizes
