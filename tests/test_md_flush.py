"""SGLang's /flush_cache on MD: refused while rooms hold radix prefixes or pool pages for KV
still crossing the WAN (a flush would hand them out again and MD's scheduler would die on its
own pool check), done as usual otherwise."""

from __future__ import annotations

from types import SimpleNamespace

from conftest import require_sglang_import


class FakeRuntime:
    def __init__(self, rooms=(), held_tokens=0):
        from sglang_pdd.sglang_glue.main_drc import MainDrcRuntime

        self.rooms = SimpleNamespace(rooms=dict.fromkeys(rooms))
        self.held_tokens = held_tokens
        self.flush_blocker = MainDrcRuntime.flush_blocker.__get__(self)


def flush(runtime):
    require_sglang_import()
    from sglang_pdd.sglang_glue.plugin import _flush_cache_without_rooms

    flushed = []
    scheduler = SimpleNamespace(_pdd_runtime=runtime)
    result = _flush_cache_without_rooms(lambda s, *a, **k: flushed.append(s) or True, scheduler)
    return result, bool(flushed)


def test_flush_refused_while_a_room_is_open(caplog):
    assert flush(FakeRuntime(rooms=[7])) == (False, False)
    assert "1 PDD rooms open" in caplog.text


def test_flush_refused_while_pages_wait_for_the_wan_to_let_go():
    assert flush(FakeRuntime(held_tokens=64)) == (False, False)


def test_flush_runs_when_md_holds_nothing_and_on_other_roles():
    assert flush(FakeRuntime()) == (True, True)
    assert flush(None) == (True, True)  # P, RLD, plain servers: SGLang's own flush
