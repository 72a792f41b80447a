"""The package bounds its awaits with asyncio.timeout, never asyncio.wait_for: on Python 3.11
wait_for returns the awaited result when its task is cancelled in the same loop iteration as
that result arrives, and the cancel is lost (a cancelled flow leg then went on reading and held
its request until the client's timeout: tests/unit/router/test_stall_deadline.py)."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "sglang_pdd"


def test_no_asyncio_wait_for_in_the_package():
    uses = [f"{path.relative_to(PACKAGE.parent)}:{n}"
            for path in sorted(PACKAGE.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if re.search(r"\basyncio\.wait_for\(|\bfrom asyncio import .*\bwait_for\b", line)]
    assert not uses, uses
