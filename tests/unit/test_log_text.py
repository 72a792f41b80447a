"""Client strings in log lines: escaped, so a newline in a request id forges no log line."""

import logging

from sglang_pdd.log_text import client_text
from tests.support.fake_backends import Knobs
from tests.support.flow_scenarios import assert_invariants, p_md_cfg, scenario


def test_client_text_escapes_what_is_not_printable_and_bounds_the_length():
    assert client_text("req-1") == "req-1"
    assert client_text("a\nINFO forged line\r\x1b[2J") == "a\\nINFO forged line\\r\\x1b[2J"
    assert client_text("x" * 500) == "x" * 200 + "..."
    assert client_text(None) == "-" and client_text(7) == "7"


def test_a_rid_with_a_newline_stays_on_its_log_line(caplog):
    """A flow's rid (the client's, where one is given) went into the router's log lines as it
    came: a newline in it wrote a line of the client's choosing into the router's log."""
    caplog.set_level(logging.INFO, logger="sglang_pdd.router")
    rid = 'r1\n[2026-01-01 00:00:00] request {"rid": "forged"}'
    run = scenario(Knobs(md_register="error500"), max_new=8, cfg=p_md_cfg(), rid=rid)
    assert_invariants(run, 8)
    lines = [r.getMessage() for r in caplog.records if "r1" in r.getMessage()]
    assert any("MD unavailable" in line for line in lines), lines  # a line that printed the rid
    assert all("\n" not in line for line in lines), lines
