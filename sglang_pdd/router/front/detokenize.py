"""Incremental detokenization of one output stream, exactly as SGLang's detokenizer does it.

SGLang (managers/detokenizer_manager.py, ``_decode_batch_token_id_output``) decodes only a
window per step: ``surr_offset..read_offset`` is context already turned into text,
``read_offset..end`` is new; the new text is ``decode(surr..end)[len(decode(surr..read)):]``.
The window starts at the prompt's last 5 tokens (``INIT_INCREMENTAL_DETOKENIZATION_OFFSET``)
so a leading space or a byte-fallback merge decodes as it does on a single server. An
incomplete UTF-8 tail ("\ufffd") is held back until the next token completes it. At the end a
matched stop string is trimmed from the text (kept with ``no_stop_trim``) and a matched stop
token is left out of the text (it stays in ``output_ids``), with SGLang's own
``trim_matched_stop``. Each step costs O(new tokens + window), not O(output): no quadratic
re-decode per stream event.
"""

from __future__ import annotations

from typing import Optional

from sglang.srt.managers.detokenizer_manager import DecodeStatus, DetokenizerManager
from sglang.srt.managers.schedule_batch import INIT_INCREMENTAL_DETOKENIZATION_OFFSET
from sglang.utils import find_printable_text


class IncrementalDetokenizer:
    """Feed ``add(new_ids)`` per stream event and ``add(last_ids, finish_reason)`` once at the end;
    each call returns the text delta, and ``text`` is everything emitted so far."""

    # SGLang's stop-trimming rule, reused as is (it reads only these two attributes of its
    # manager; the gpt-oss tool-call special case does not apply to the router's models).
    trim_matched_stop = DetokenizerManager.trim_matched_stop
    is_tool_call_parser_gpt_oss = False
    tool_close_token_ids = frozenset()

    def __init__(self, tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, no_stop_trim: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.no_stop_trim = no_stop_trim
        surr = max(len(prompt_ids) - INIT_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        self.status = DecodeStatus(decoded_text="", decode_ids=list(prompt_ids[surr:]), surr_offset=0,
                                   read_offset=len(prompt_ids) - surr)
        self.text = ""
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def may_finish_with(self, new_ids: list[int], stop_strs: list[str], stop_ids: set[int]) -> bool:
        """Could a step with these ids be the request's last (a stop token, or a stop string in the
        text so far)? The router learns a finish reason only after the flow's last tokens, so a
        stream holds such a step back until it knows, and trims the stop exactly as SGLang."""
        if any(t in stop_ids for t in new_ids):
            return True
        if not stop_strs:
            return False
        s = self.status
        window = self._decode(s.decode_ids[s.surr_offset:] + list(new_ids))
        return any(stop in window for stop in stop_strs) or any(stop in self.text[-len(stop):] + window
                                                                for stop in stop_strs)

    def add(self, new_ids: list[int], finish_reason: Optional[dict] = None) -> str:
        if self.finished:
            raise RuntimeError("this output stream has already finished")
        s = self.status
        s.decode_ids.extend(new_ids)
        read_ids = self.trim_matched_stop(s.decode_ids[s.surr_offset:], finish_reason, self.no_stop_trim)
        surr_text = self._decode(s.decode_ids[s.surr_offset:s.read_offset])
        new_text = self._decode(read_ids)[len(surr_text):]
        if finish_reason is None:
            pending = s.sent_offset - s.decoded_text_len
            if new_text and not new_text.endswith("\ufffd"):
                s.append_decoded_text(new_text)
                s.surr_offset = s.read_offset
                s.read_offset = len(s.decode_ids)
                s.sent_offset = s.decoded_text_len
                delta = new_text[pending:] if pending else new_text
            else:  # incomplete UTF-8: emit the printable prefix only, retry with more tokens
                printable = find_printable_text(new_text)
                s.sent_offset = s.decoded_text_len + len(printable)
                delta = printable[pending:] if pending else printable
        else:
            self.finished = True
            output = self.trim_matched_stop(s.get_decoded_text() + new_text, finish_reason, self.no_stop_trim)
            # As in SGLang, text already streamed stays streamed (the sum of deltas is the text).
            delta = output[s.sent_offset:]
            s.sent_offset = len(output)
        self.text += delta
        return delta
