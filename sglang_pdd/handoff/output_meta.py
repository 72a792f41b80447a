"""Per-position output metadata (logprobs) of one client stream stitched from several legs (pure).

Each leg (RLD's legs, MD's continuation) reports SGLang's cumulative meta_info lists; a list
covers the LAST ``len(list)`` of the positions the leg has produced (a server that resumed k
tokens cannot give their logprobs: its list may be shorter by k, or hold placeholders there,
``None`` or ``[None, token_id, text]`` as sglang_glue/md/resume.py documents).
A position's entry comes from the leg that emitted its token; where that leg gave none, it is
spliced from any other leg that did (e.g. RLD's logprob for a position MD resumed). The
prompt's logprobs (``input_*``) come from P's reply alone (``observe_prefill``).
"""

from __future__ import annotations

from typing import Any, Hashable, Optional

PREFILL = ("p", 1)  # P's reply to the first leg, as an output source (its first position)
OUTPUT_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
INPUT_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def requested_keys(extras: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The (output, input) keys SGLang fills for a request with these logprob fields."""
    if not extras.get("return_logprob"):
        return (), ()
    out, inp = ["output_token_logprobs"], ["input_token_logprobs"]
    if int(extras.get("top_logprobs_num") or 0) > 0:
        out.append("output_top_logprobs")
        inp.append("input_top_logprobs")
    if extras.get("token_ids_logprob") is not None:  # SGLang's test: even an empty list
        out.append("output_token_ids_logprobs")
        inp.append("input_token_ids_logprobs")
    return tuple(out), tuple(inp)


class OutputMeta:
    def __init__(self, extras: dict):
        self.output_keys, self.input_keys = requested_keys(extras)
        self._sources: dict[Hashable, dict[str, tuple[int, list]]] = {}  # source -> key -> (produced, list)
        self._rows: dict[str, list] = {k: [] for k in self.output_keys}
        self._holes: dict[str, set[int]] = {k: set() for k in self.output_keys}
        self._input: dict[str, list] = {}  # the prompt's logprob lists, from P's reply

    def observe(self, source: Hashable, produced: int, meta: dict) -> None:
        """A leg's stream event: ``produced`` positions so far and its meta_info."""
        if not self.output_keys:
            return
        lists = self._sources.setdefault(source, {})
        for key in self.output_keys:
            value = meta.get(key)
            if isinstance(value, list):
                lists[key] = (produced, value)

    def observe_prefill(self, meta: dict) -> None:
        """P's reply to the first leg.

        The prompt's logprobs: P prefills the prompt; the decode servers report none (SGLang's
        PD decode never scores the prompt, MD's resumed request gives ``[]``:
        sglang_glue/md/resume.py), so P's lists are taken as they are, ``logprob_start_len`` and
        the leading ``None`` entry included. P's entries for the first output position are a
        source like a leg's: RLD, handed P's first token, has no ``output_token_ids_logprobs``
        entry for it."""
        for key in self.input_keys:
            if isinstance(meta.get(key), list):
                self._input[key] = meta[key]
        lists = self._sources.setdefault(PREFILL, {})
        for key in self.output_keys:
            if isinstance(meta.get(key), list):  # from output position 0: P resumes nothing
                lists[key] = (len(meta[key]), meta[key])

    def missing_input(self) -> list[str]:
        """The prompt's logprob lists asked for that P's reply did not carry."""
        return [key for key in self.input_keys if key not in self._input]

    def entry(self, source: Hashable, key: str, pos: int) -> Optional[Any]:
        """``source``'s entry for output position ``pos``; None where it gave none (also a
        resumed position's placeholder ``[None, token_id, text]``)."""
        produced, values = self._sources.get(source, {}).get(key, (0, []))
        j = pos - (produced - len(values))
        value = values[j] if 0 <= j < len(values) else None
        if isinstance(value, (list, tuple)) and key == "output_token_logprobs" and value and value[0] is None:
            return None
        return value

    def emitted(self, source: Hashable, start: int, end: int) -> None:
        """Positions ``start..end-1`` were emitted from ``source``'s tokens."""
        for key in self.output_keys:
            rows = self._rows[key]
            assert len(rows) == start, (key, len(rows), start)
            for pos in range(start, end):
                value = self.entry(source, key, pos)
                rows.append(value)
                if value is None:
                    self._holes[key].add(pos)

    def as_dict(self, finish_reason: Optional[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        """Lists are the live ones (read, do not mutate)."""
        self._splice()
        out: dict[str, Any] = {key: self._rows[key] for key in self.output_keys}
        for key in self.input_keys:
            out[key] = self._input.get(key)
        out.update(finish_reason=finish_reason, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        return out

    def _splice(self) -> None:
        for key, holes in self._holes.items():
            for pos in sorted(holes):
                for source in self._sources:
                    value = self.entry(source, key, pos)
                    if value is not None:
                        self._rows[key][pos] = value
                        holes.discard(pos)
                        break
