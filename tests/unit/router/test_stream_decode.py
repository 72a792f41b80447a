"""router/backends/stream_decode.py: a cumulative stream's events decoded incrementally are what parsing
each event whole gives (for what the router reads), and each position's entries are built once."""

from __future__ import annotations

import json
import random

import orjson
import pytest

from sglang_pdd.router.backends.stream_decode import OUTPUT_KEYS, CumulativeDecoder, MalformedEvent, parse_whole


def read_fields(event: dict) -> dict:
    """What the router reads of a stream event."""
    out = {k: event[k] for k in ("output_ids", "error") if k in event}
    if isinstance(event.get("meta_info"), dict):
        meta = event["meta_info"]
        out["meta_info"] = {"finish_reason": meta.get("finish_reason"),
                            **{k: meta[k] for k in OUTPUT_KEYS if k in meta}}
    elif "meta_info" in event:
        out["meta_info"] = event["meta_info"]
    return out


def cumulative_stream(n: int, top: int, seed: int = 0, resumed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    ids, entries, lines = [], [], []
    for i in range(n):
        t = rng.randrange(1000)
        ids.append(t)
        if i >= resumed:
            entries.append([-rng.random() * 10, t, None])
        meta = {"id": "x", "finish_reason": {"type": "length", "length": n} if i == n - 1 else None,
                "output_token_logprobs": list(entries), "output_top_logprobs": [[e] * top for e in entries],
                "output_token_ids_logprobs": [None if j == 0 else [e] for j, e in enumerate(entries)],
                "input_token_logprobs": [], "cached_tokens": 3, "completion_tokens": i + 1}
        lines.append(orjson.dumps({"text": "t" * i, "output_ids": list(ids), "meta_info": meta}))
    return lines


@pytest.mark.parametrize("resumed", [0, 3])
def test_a_cumulative_stream_decodes_as_parsing_each_event_whole_and_parses_each_entry_once(resumed):
    lines = cumulative_stream(60, 4, resumed=resumed)
    decoder = CumulativeDecoder()
    for line in lines:
        assert decoder.decode(line) == read_fields(orjson.loads(line))
    # every position once per list (parsing each event whole: ~n^2/2 per list)
    assert decoder.entries_parsed == 3 * (60 - resumed)


def test_a_list_that_does_not_continue_the_last_one_is_parsed_whole():
    decoder = CumulativeDecoder()
    events = [{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1.0, 1, None]]}},
              {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1.5, 1, None], [-2.0, 2, None]]}},
              {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1.5, 1, None], [-2.0, 23, None]]}},
              {"output_ids": [1, 2, 3], "meta_info": {"output_token_logprobs": None}},
              {"output_ids": [1, 2, 3], "meta_info": {"output_token_logprobs": [[-1.5, 1, None], [-2.0, 2, None]]}},
              {"output_ids": [1, 2, 3], "meta_info": {"output_token_logprobs": [[-1.5, 1, None], [-2.0, 2, None],
                                                                              [float("nan"), 3, None]]}}]
    for event in events:
        line = json.dumps(event).encode()  # json's spacing and NaN: not what orjson writes
        assert decoder.decode(line) == read_fields(parse_whole(line)) or "nan" in str(event)
    last = decoder.decode(json.dumps(events[-1]).encode())
    assert last["meta_info"]["output_token_logprobs"][2][0] != last["meta_info"]["output_token_logprobs"][2][0]


def test_numbers_edits_and_odd_events_match_a_whole_parse():
    decoder = CumulativeDecoder()
    for line in [b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1, 1, null]]}}',
                 b'{"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1, 1, null],[-1e400, 2, null]]}}',
                 b'{"output_ids": [1, 99999999999999999999999], "meta_info": {"finish_reason": {"type": "stop"}}}',
                 b'{"error": "boom"}', b'{"meta_info": null}', b'{"meta_info": [1]}', b'[1, 2]', b'7']:
        try:
            want = parse_whole(line)
        except MalformedEvent:
            with pytest.raises(MalformedEvent):
                decoder.decode(line)
            continue
        got = decoder.decode(line)
        assert (got == read_fields(want)) if isinstance(want, dict) and isinstance(want.get("meta_info", {}), (dict, type(None))) \
            else got == want
    with pytest.raises(MalformedEvent):
        decoder.decode(b'{"output_ids": [1,')


def test_each_event_gets_its_own_lists_and_earlier_ones_never_change():
    decoder = CumulativeDecoder()
    lines = cumulative_stream(5, 2)
    first = decoder.decode(lines[0])
    kept = [list(v) for k, v in first["meta_info"].items() if k in OUTPUT_KEYS]
    for line in lines[1:]:
        decoder.decode(line)
    assert [first["meta_info"][k] for k in OUTPUT_KEYS] == kept and len(kept[0]) == 1
