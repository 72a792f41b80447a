"""One backend /generate stream's events decoded without re-parsing what the last event carried (pure).

SGLang streams cumulatively: each event repeats every logprob entry so far, so parsing each
event whole turns an n-token stream into ~n^2/2 entries built as Python objects (most of the
router's CPU on a long logprob stream). A stream's logprob lists only grow: the bytes of an
event's list start with the bytes of the previous event's list, less its closing bracket. The
decoder checks exactly that (a byte comparison) and parses only the new entries, appended to
the entries it parsed before (``output_ids`` alike); anything else (a list that changed, an
unusual value) is parsed whole, so the result is always what parsing the event whole gives.

The decoded event holds what the router reads of a stream event: ``output_ids``,
``meta_info.finish_reason``, the output logprob lists (``OUTPUT_KEYS``) and ``error``. Each
list is a new list object per event; its entries are shared with the previous event's (nobody
mutates them).
"""

from __future__ import annotations

import json
from typing import Any, Optional

import msgspec
import orjson

OUTPUT_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


# Every field as its raw bytes: the values are orjson's, as a whole parse gives them (e.g. an
# integer past 64 bits is a float there), only the logprob lists are parsed in parts.
class _Meta(msgspec.Struct):
    finish_reason: msgspec.Raw = msgspec.UNSET
    output_token_logprobs: msgspec.Raw = msgspec.UNSET
    output_top_logprobs: msgspec.Raw = msgspec.UNSET
    output_token_ids_logprobs: msgspec.Raw = msgspec.UNSET


class _Event(msgspec.Struct):
    output_ids: msgspec.Raw = msgspec.UNSET
    meta_info: Optional[_Meta] = msgspec.UNSET
    error: msgspec.Raw = msgspec.UNSET


_decoder = msgspec.json.Decoder(_Event)


class MalformedEvent(ValueError):
    """Not a JSON object (or not JSON at all)."""


def parse_whole(data: bytes) -> Any:
    """An event parsed whole (orjson; json for what orjson refuses: NaN, integers past 64 bits)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            return json.loads(data)
        except json.JSONDecodeError as e:
            raise MalformedEvent(str(e)) from None


class CumulativeDecoder:
    """Decodes the events of one stream, in order (``decode``)."""

    def __init__(self):
        # key -> (the previous event's list bytes without the closing bracket, its entries)
        self._lists: dict[str, tuple[bytes, list]] = {}
        self.entries_parsed = 0  # logprob positions built as objects (statistics, tests)

    def decode(self, data: bytes) -> Any:
        """The event in ``data`` (one SSE data payload); raises MalformedEvent."""
        try:
            event = _decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self._whole(data)  # not an object of the usual shape: as before, no shortcut
        out: dict[str, Any] = {}
        if event.error is not msgspec.UNSET:
            out["error"] = parse_whole(bytes(event.error))
        if event.output_ids is not msgspec.UNSET:  # cumulative too: parsed in parts as well
            out["output_ids"] = self._list("output_ids", bytes(event.output_ids))
        meta = event.meta_info
        if meta is None:
            out["meta_info"] = None
        elif meta is not msgspec.UNSET:
            out["meta_info"] = info = {"finish_reason": None if meta.finish_reason is msgspec.UNSET
                                       else parse_whole(bytes(meta.finish_reason))}
            for key in OUTPUT_KEYS:
                raw = getattr(meta, key)
                if raw is not msgspec.UNSET:
                    info[key] = self._list(key, bytes(raw))
        return out

    def _list(self, key: str, raw: bytes) -> Any:
        before = self._lists.get(key)
        if before is not None and raw.startswith(before[0]) and raw.endswith(b"]"):
            new = self._new_entries(raw[len(before[0]):-1].strip(), bool(before[1]))
            if new is not None:
                entries = before[1]
                entries.extend(new)
                self.entries_parsed += len(new) if key != "output_ids" else 0
                self._lists[key] = (raw[:-1], entries)
                return list(entries)
        try:
            value = parse_whole(raw)
        finally:
            self._lists.pop(key, None)
        if isinstance(value, list):
            self.entries_parsed += len(value) if key != "output_ids" else 0
            self._lists[key] = (raw[:-1], list(value))
        return value

    @staticmethod
    def _new_entries(tail: bytes, after_entries: bool) -> Optional[list]:
        """The entries the list's bytes add after the previous event's (``tail``: between its
        bytes and the closing bracket); None where that is no whole list of entries."""
        if not tail:
            return []
        if after_entries:  # ",e1,e2": a comma ends the last entry the previous event had
            if not tail.startswith(b","):
                return None  # e.g. "[1,2]" -> "[1,23]": the last entry itself changed
            tail = tail[1:]
        elif tail.startswith(b","):
            return None
        try:
            new = orjson.loads(b"[" + tail + b"]")
        except orjson.JSONDecodeError:
            return None  # parsed whole (json reads what orjson refuses)
        return new if isinstance(new, list) else None

    def _whole(self, data: bytes) -> Any:
        self._lists.clear()
        event = parse_whole(data)
        if isinstance(event, dict) and isinstance(event.get("meta_info"), dict):
            self.entries_parsed += sum(len(v) for k, v in event["meta_info"].items()
                                       if k in OUTPUT_KEYS and isinstance(v, list))
        return event
