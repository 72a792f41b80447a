"""A client's string as a log line may carry it (pure).

A request id, a model name or anything else a client chose goes into the router's log lines;
unescaped, a newline in it starts a forged line of its own (and an escape sequence rewrites a
terminal). Every log call that prints such a string passes it through ``client_text``.
"""

from __future__ import annotations

MAX_LOGGED_CHARS = 200


def client_text(value: object, limit: int = MAX_LOGGED_CHARS) -> str:
    """``value`` as text with every non-printable character escaped (``\\n``, ``\\x1b``, ...),
    cut at ``limit`` characters (marked with an ellipsis); None as ``-``."""
    if value is None:
        return "-"
    text = str(value)
    cut = len(text) > limit
    text = text[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text + "..." if cut else text
