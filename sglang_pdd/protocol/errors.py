"""The one error type of the control APIs: it carries its HTTP status, so a server answers
with the status the error was raised with, never one guessed from its text."""

from __future__ import annotations

from typing import Optional

# kind -> HTTP status (the kinds the control APIs answer with)
STATUS = {
    "bad_request": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "timeout": 408,
    "conflict": 409,
    "gone": 410,
    "length_required": 411,
    "too_large": 413,
    "internal": 500,
    "busy": 503,
}


class ControlError(ValueError):
    """Answer a control request with ``status`` and ``{"error": message}`` (``headers`` too,
    e.g. Retry-After). ``kind`` names the class of problem (``STATUS``'s keys). A ValueError:
    a malformed message is a bad value wherever it is parsed."""

    def __init__(self, status: int, kind: str, message: str, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers

    @classmethod
    def of(cls, kind: str, message: str, headers: Optional[dict] = None) -> "ControlError":
        return cls(STATUS[kind], kind, message, headers)

    def to_json(self) -> dict:
        """The reply's body (the kind stays in the status: the wire carries only the message)."""
        return {"error": self.message}

    def __repr__(self) -> str:
        return f"ControlError({self.status}, {self.kind!r}, {self.message!r})"


def bad_request(message: str) -> ControlError:
    return ControlError.of("bad_request", message)
