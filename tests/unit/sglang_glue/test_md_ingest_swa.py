"""A hybrid sliding-window pool through the WAN path, on SGLang's own pools, allocator and
SWA-aware radix cache (CPU): P's real fan-out sends every full-attention page MD lacks and
only the window's pages of the sliding layers; MD reserves sliding-window slots for the
window only, lands the bytes at its own translated slots, and inserts the prompt with the
tokens before the window as SWA tombstones, so a later match never ends where the window is
missing. Every slot of both pools is accounted for at every step."""

import numpy as np
import pytest
import torch

from sglang_pdd.protocol import KvSize, RegisterReply, RegisterRequest, ReleaseRequest
from tests.support.md_runtime import KEY, close, drive_until, settle
from tests.conftest import require_sglang_import

WINDOW = 32
FULL_SIZE, SWA_SIZE = 1024, 384


def swa_pool(seed=None, page_size: int = 1):
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(size=FULL_SIZE, size_swa=SWA_SIZE, page_size=page_size, dtype=torch.float32, head_num=2,
                     head_dim=8, swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3], device="cpu",
                     enable_memory_saver=False)
    alloc = SWATokenToKVPoolAllocator(FULL_SIZE, SWA_SIZE, page_size, torch.float32, "cpu", pool, need_sort=False)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for buf in full_bufs(pool) + swa_bufs(pool):
            buf.copy_(torch.randn(buf.shape, generator=g))
    return pool, alloc


def full_bufs(pool):
    return [*pool.full_kv_pool.k_buffer, *pool.full_kv_pool.v_buffer]


def swa_bufs(pool):
    return [*pool.swa_kv_pool.k_buffer, *pool.swa_kv_pool.v_buffer]


def build_hybrid_md(page_size: int = 1, window: int = WINDOW):
    require_sglang_import()
    from types import SimpleNamespace

    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from sglang_pdd.config import PddConfig
    from sglang_pdd.launcher.topology import free_port
    from sglang_pdd.sglang_glue.md.main_drc import MainDrcRuntime

    pool, alloc = swa_pool(page_size=page_size)
    tree = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                             page_size=page_size, sliding_window_size=window,
                                             tree_components=(ComponentType.FULL, ComponentType.SWA)))
    cfg = PddConfig(role="main", wan_listen=f"127.0.0.1:{free_port()}", control_listen=f"127.0.0.1:{free_port()}",
                    wan_timeout_s=10.0, md_staging_mb=64)
    sched = SimpleNamespace(server_args=SimpleNamespace(port=1), tree_cache=tree, page_size=page_size,
                            idle_sleeper=None, sliding_window_size=window)
    return MainDrcRuntime(sched, cfg, KEY)


class HybridPrefill:
    """P: an SWAKVPool holding prompts at slots of its own (full and sliding differ), the real fan-out."""

    def __init__(self, md, page_size: int = 1, window: int = WINDOW):
        from sglang_pdd.sglang_glue.p.wan_fanout import WanFanout

        self.md, self.page_size = md, page_size
        self.pool, self.alloc = swa_pool(seed=7, page_size=page_size)
        # P's sliding slots differ from its full ones
        self.alloc.swa_attn_allocator.alloc(11 if page_size == 1 else 3 * page_size)
        self.fanout = WanFanout(KEY, "p-swa", num_streams=2, timeout_s=10.0, allowed_peers=[tuple(md.receiver.address)])
        self.fanout.attach_pool(self.pool, page_size, window=window)

    def prompt_slots(self, n, prefix_slots=None):
        """Slots for tokens [len(prefix_slots), n) after a prefix at ``prefix_slots``, as SGLang's
        scheduler takes them (whole pages in both pools at page size > 1)."""
        if self.page_size == 1:
            return self.alloc.alloc(n - (0 if prefix_slots is None else len(prefix_slots)))
        prefix = 0 if prefix_slots is None else len(prefix_slots)
        last = -1 if prefix_slots is None else int(prefix_slots[-1])
        return self.alloc.alloc_extend(torch.tensor([prefix]), torch.tensor([prefix]), torch.tensor([n]),
                                       torch.tensor([n]), torch.tensor([last]), n - prefix)

    def send(self, room, token_ids, md_prefix_len, slots):
        from sglang_pdd.sglang_glue.p.wan_fanout import WanDestination

        dest = WanDestination(room, self.md.receiver.address, md_prefix_len)
        wan_room = self.fanout.open_room(dest, rid=f"r{room}", token_ids=token_ids, first_offered_page=0)
        assert wan_room is not None
        pages = (slots[::self.page_size] // self.page_size).numpy().astype(np.int64)
        half = len(pages) // 2  # two offers, as chunked prefill would
        self.fanout.offer(wan_room, pages[:half])
        self.fanout.offer(wan_room, pages[half:], last=True)
        return wan_room

    def rows(self, slots, start, end, window=False):
        idx = slots[start:end].to(torch.int64)
        if window:
            return [b[self.pool.translate_loc_from_full_to_swa(idx)] for b in swa_bufs(self.pool)]
        return [b[idx] for b in full_bufs(self.pool)]


def md_slots(md, token_ids):
    _, node = md.ops.match(token_ids)
    return md.ops.tree.path_device_indices(node).to(torch.int64)


def md_rows(md, slots, window=False):
    pool = md.ops.pool
    if window:
        return [b[pool.translate_loc_from_full_to_swa(slots)] for b in swa_bufs(pool)]
    return [b[slots] for b in full_bufs(pool)]


def conserved(md):
    """SGLang's identity for both pools of the hybrid allocator (its idle leak check's terms),
    with what MD holds for rooms in flight."""
    tree, alloc, pages = md.ops.tree, md.ops.allocator, md.rank_rooms.pages
    full = (alloc.full_available_size() + tree.full_evictable_size() + tree.full_protected_size()
            + pages.held_tokens) == alloc.size_full
    swa = (alloc.swa_available_size() + tree.swa_evictable_size() + tree.swa_protected_size()
           + pages.held_swa_tokens) == alloc.size_swa
    return full and swa


def assert_router_estimate_is_what_p_sent(reg, prompt_tokens: int, sent: int, landed: int) -> None:
    """MD's KV size as the router reads it from the registration answer (the full layers per
    token, the window's layers per window token) gives the bytes P's fan-out sent, and MD
    counts as much ``landed``; the sliding layers counted per token would be more."""
    size = RegisterReply.from_json(reg.to_json()).kv_size
    assert size == KvSize(4 * 64, WINDOW, 4 * 64)
    assert size.wan_bytes(prompt_tokens, reg.cached_tokens) == sent == landed
    assert (prompt_tokens - reg.cached_tokens) * 8 * 64 > sent


def landed_bytes(md) -> int:
    return md.rank_rooms.drc_stats.bytes_received


def assert_md_holds_ps_rows(p, md, slots, got, window_from: int, full: bool = True) -> None:
    """MD's rows at ``got`` (its slots of the prompt's first ``len(got)`` tokens) equal P's at
    ``slots``: the full layers' for every token (unless not ``full``), the sliding layers' from
    token ``window_from`` on."""
    n = got.numel()
    if full:
        for want, have in zip(p.rows(slots, 0, n), md_rows(md, got)):
            assert torch.equal(want, have)
    for want, have in zip(p.rows(slots, window_from, n, window=True), md_rows(md, got[window_from:], window=True)):
        assert torch.equal(want, have)


def test_md_announces_the_hybrid_layout_and_holds_window_slots_only_for_the_window():
    md = build_hybrid_md()
    try:
        layout = md.ops.pool_layout
        assert (layout.layers, layout.window_layers, layout.window) == (4, 2, WINDOW)
        reg = md.rank_rooms.register(RegisterRequest(1, list(range(50))))
        assert reg.kv_layout["window_layers"] == 2 and reg.kv_layout["window"] == WINDOW
        md.rank_rooms.release(ReleaseRequest(1))
        settle(md)
        assert conserved(md)
    finally:
        close(md)


def test_window_only_lands_and_the_tree_holds_tombstones_before_it():
    md = build_hybrid_md()
    p = HybridPrefill(md)
    try:
        ids = list(range(1000, 1150))  # 150 tokens: the window is the last 32
        swa_free = md.ops.allocator.swa_available_size()
        reg = md.rank_rooms.register(RegisterRequest(1, ids))
        assert reg.cached_tokens == 0
        # full slots for all 150, sliding-window slots for the window only
        assert md.rank_rooms.pages.held_tokens == 150 and md.rank_rooms.pages.held_swa_tokens == WINDOW
        assert md.ops.allocator.swa_available_size() == swa_free - WINDOW and conserved(md)
        slots = p.prompt_slots(len(ids))
        room = p.send(1, ids, reg.cached_tokens, slots)
        drive_until(md, 1)
        # P sent 4 full buffers x 150 tokens + 4 sliding buffers x 32 tokens (64 B rows)
        sent = sum(s.plan.total_bytes for s in room.shares)
        assert sent == (4 * 150 + 4 * WINDOW) * 64
        assert_router_estimate_is_what_p_sent(reg, len(ids), sent, landed_bytes(md))
        got = md_slots(md, ids)
        assert got.numel() == len(ids)
        assert_md_holds_ps_rows(p, md, slots, got, window_from=150 - WINDOW)
        # the tokens before the window have no sliding-window KV on MD (tombstones)
        mapping = md.ops.allocator.full_to_swa_index_mapping
        assert not (mapping[got[:150 - WINDOW]] > 0).any() and (mapping[got[-WINDOW:]] > 0).all()
        settle(md)
        assert md.rank_rooms.pages.held_tokens == 0 and md.rank_rooms.pages.held_swa_tokens == 0 and conserved(md)
        # a later prompt that shares only the first 100 tokens cannot reuse them: the window
        # before token 100 is not on MD (SGLang's SWA-aware match)
        branch = ids[:100] + list(range(5000, 5040))
        assert md.ops.match(branch)[0] == 0
        md.rank_rooms.release(ReleaseRequest(1))
        settle(md)
        assert conserved(md)
    finally:
        close(md, p)


def test_second_turn_hits_the_window_and_p_sends_only_the_rest():
    md = build_hybrid_md()
    p = HybridPrefill(md)
    try:
        first = list(range(2000, 2120))
        reg = md.rank_rooms.register(RegisterRequest(1, first))
        slots1 = p.prompt_slots(len(first))
        p.send(1, first, reg.cached_tokens, slots1)
        drive_until(md, 1)
        md.rank_rooms.release(ReleaseRequest(1))
        second = first + list(range(3000, 3045))  # extends turn 1: its window is on MD
        reg = md.rank_rooms.register(RegisterRequest(2, second))
        assert reg.cached_tokens == len(first)
        # the window of the 165-token prompt reaches back to token 133, past turn 1's end: 32 tokens
        assert md.rank_rooms.pages.held_swa_tokens == WINDOW
        slots2 = torch.cat([slots1, p.prompt_slots(45)])
        before = landed_bytes(md)
        room = p.send(2, second, reg.cached_tokens, slots2)
        drive_until(md, 2)
        sent = sum(s.plan.total_bytes for s in room.shares)
        assert sent == (4 * 45 + 4 * WINDOW) * 64
        assert_router_estimate_is_what_p_sent(reg, len(second), sent, landed_bytes(md) - before)
        got = md_slots(md, second)
        assert got.numel() == len(second)
        # turn 1's prefix and turn 2's suffix
        assert_md_holds_ps_rows(p, md, slots2, got, window_from=len(second) - WINDOW)
        md.rank_rooms.release(ReleaseRequest(2))
        settle(md)
        assert conserved(md)
    finally:
        close(md, p)


def test_a_fully_cached_prompt_matches_only_where_the_window_before_its_last_token_is_cached():
    """MD sends at least the prompt's last token: its cached prefix is the SWA-aware match of
    the prompt without it. Matching the whole prompt and cutting back claimed a prefix whose
    window MD does not hold (the insert then found "locked prefix shrank")."""
    md = build_hybrid_md()
    p = HybridPrefill(md)
    try:
        ids = list(range(4000, 4150))
        reg = md.rank_rooms.register(RegisterRequest(1, ids))
        slots = p.prompt_slots(len(ids))
        p.send(1, ids, reg.cached_tokens, slots)
        drive_until(md, 1)
        md.rank_rooms.release(ReleaseRequest(1))
        assert md.ops.match(ids)[0] == len(ids)  # the whole prompt: its window is on MD
        assert md.ops.match(ids[:-1])[0] == 0  # without its last token: token 117 is not
        reg = md.rank_rooms.register(RegisterRequest(2, ids))
        assert reg.cached_tokens == 0
        room = p.send(2, ids, reg.cached_tokens, slots)
        drive_until(md, 2)  # lands and enters the tree (the tree keeps its own copy)
        assert sum(s.plan.total_bytes for s in room.shares) == (4 * 150 + 4 * WINDOW) * 64
        assert md.ops.match(ids)[0] == len(ids)
        md.rank_rooms.release(ReleaseRequest(2))
        settle(md)
        assert md.rank_rooms.pages.held_tokens == 0 and conserved(md)
    finally:
        close(md, p)


def test_a_failed_room_gives_back_its_window_slots():
    md = build_hybrid_md()
    try:
        swa_free, full_free = md.ops.allocator.swa_available_size(), md.ops.allocator.full_available_size()
        md.rank_rooms.register(RegisterRequest(1, list(range(80))))
        assert md.rank_rooms.pages.held_swa_tokens == WINDOW
        md.rank_rooms.release(ReleaseRequest(1))  # released in flight: nothing landed
        settle(md)
        assert md.ops.allocator.swa_available_size() == swa_free
        assert md.ops.allocator.full_available_size() == full_free and conserved(md)
    finally:
        close(md)


def test_an_swa_pool_without_its_window_or_outside_it_is_refused_clearly():
    require_sglang_import()
    from sglang_pdd.sglang_glue.kv_pool_view import UnsupportedKvPool, gather_buffer_pages, pool_layout

    pool, alloc = swa_pool(seed=1)
    with pytest.raises(UnsupportedKvPool, match="sliding-window layers but no sliding window size"):
        pool_layout(pool, 1)
    slots = alloc.alloc(40)
    alloc.free_swa(slots[:8])  # out of the window: SGLang frees their sliding-window slots
    assert gather_buffer_pages(pool, 5, slots[8:], 1).numel() == 32 * 64
    with pytest.raises(ValueError, match="8 of 40 pages have no sliding-window KV"):
        gather_buffer_pages(pool, 5, slots, 1)  # never reads another slot's KV instead
    assert gather_buffer_pages(pool, 0, slots, 1).numel() == 40 * 64  # full layers: all of them


PAGE = 16


def test_at_page_size_16_whole_pages_and_the_windows_pages_land_and_a_second_turn_hits():
    """The same path on paged pools (SGLang's paged SWA allocator, both pools paging in step):
    MD reserves whole pages, the window from its first page on; the tree takes whole pages
    only, the tokens before the window's page as tombstones; a second turn extending the
    first hits every whole page of it and lands only the pages after."""
    md = build_hybrid_md(PAGE)
    p = HybridPrefill(md, PAGE)
    try:
        ids = list(range(1000, 1150))  # 150 tokens: 10 pages; the window (32) from page 7 (token 112)
        reg = md.rank_rooms.register(RegisterRequest(1, ids))
        assert reg.cached_tokens == 0
        assert (md.rank_rooms.pages.held_tokens, md.rank_rooms.pages.held_swa_tokens) == (160, 48) and conserved(md)
        slots = p.prompt_slots(len(ids))
        room = p.send(1, ids, reg.cached_tokens, slots)
        drive_until(md, 1)
        sent = sum(s.plan.total_bytes for s in room.shares)
        assert sent == (4 * 160 + 4 * 48) * 64  # whole pages: 4 full buffers x 10, 4 sliding x 3
        # the router's estimate counts tokens, not the last page's padding
        assert 0 <= sent - reg.kv_size.wan_bytes(len(ids), 0, PAGE) < 2 * PAGE * 4 * 64
        got = md_slots(md, ids)
        assert got.numel() == 144  # whole pages only: the partial tenth is freed
        assert_md_holds_ps_rows(p, md, slots, got, window_from=112)
        mapping = md.ops.allocator.full_to_swa_index_mapping
        assert not (mapping[got[:112]] > 0).any() and (mapping[got[112:]] > 0).all()
        settle(md)
        assert md.rank_rooms.pages.held_tokens == 0 and md.rank_rooms.pages.held_swa_tokens == 0 and conserved(md)
        md.rank_rooms.release(ReleaseRequest(1))

        second = ids + list(range(3000, 3045))  # 195 tokens: 13 pages
        reg = md.rank_rooms.register(RegisterRequest(2, second))
        assert reg.cached_tokens == 144
        # pages 9-12 (full), and of the window (from token 163: page 10) pages 10-12
        assert (md.rank_rooms.pages.held_tokens, md.rank_rooms.pages.held_swa_tokens) == (64, 48)
        slots2 = torch.cat([slots, p.prompt_slots(len(second), slots)])
        room = p.send(2, second, reg.cached_tokens, slots2)
        drive_until(md, 2)
        assert sum(s.plan.total_bytes for s in room.shares) == (4 * 64 + 4 * 48) * 64
        got = md_slots(md, second)
        assert got.numel() == 192
        assert_md_holds_ps_rows(p, md, slots2, got, window_from=160)
        md.rank_rooms.release(ReleaseRequest(2))
        settle(md)
        assert conserved(md)
    finally:
        close(md, p)


def test_at_page_size_16_a_prompt_ending_early_in_its_last_page_keeps_a_whole_window_before_its_last_full_page():
    """The tree takes whole pages only, so a 111-token prompt enters it up to token 96; the
    window P sends (31 tokens: SGLang's for the tiny model) must reach back a whole window from
    there (token 65, so page 4), not only from the prompt's end (token 80, page 5): with the SWA
    KV of tokens 80-95 only, SGLang's SWA-aware match found no prefix at all and the room failed
    (`only 0 cached after insert`)."""
    md = build_hybrid_md(PAGE, window=31)
    p = HybridPrefill(md, PAGE, window=31)
    try:
        ids = list(range(4000, 4111))
        reg = md.rank_rooms.register(RegisterRequest(1, ids))
        slots = p.prompt_slots(len(ids))
        room = p.send(1, ids, reg.cached_tokens, slots)
        drive_until(md, 1)
        assert md.rank_rooms.counters["rooms_failed"] == 0 and md.rank_rooms.counters["rooms_ready"] == 1
        # full pages 0-6, the window's from page 4 (token 64)
        assert sum(s.plan.total_bytes for s in room.shares) == (4 * 112 + 4 * 48) * 64
        got = md_slots(md, ids)
        assert got.numel() == 96
        assert_md_holds_ps_rows(p, md, slots, got, window_from=64, full=False)
        md.rank_rooms.release(ReleaseRequest(1))
        # a second turn extending it hits all of its whole pages
        second = ids + list(range(5000, 5020))
        assert md.rank_rooms.register(RegisterRequest(2, second)).cached_tokens == 96
        md.rank_rooms.release(ReleaseRequest(2))
        settle(md)
        assert conserved(md)
    finally:
        close(md, p)
