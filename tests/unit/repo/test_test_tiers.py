"""scripts/test.sh selects end-to-end modules by marker, never by a hand-kept list: every
tests/test_e2e_*.py carries the e2e marker, and lands in exactly one shard of the full tier."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_SH = (REPO / "scripts" / "test.sh").read_text()
E2E_MODULES = sorted((REPO / "tests").glob("test_e2e_*.py"))


def module_markers(path: Path) -> set[str]:
    """The markers of a module's ``pytestmark`` (``pytest.mark.NAME``, alone or in a list)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            return {n.attr for n in ast.walk(node.value)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
    return set()


def shard_expressions() -> list[str]:
    """The -m expressions of the full tier's shards (the lines after ``else``)."""
    full = TEST_SH[TEST_SH.index('if [ "$FULL" = 0 ]'):]
    full = full[full.index("else"):full.index("\nfi\n")]
    return re.findall(r'-m "([^"]+)"', full)


def selects(expression: str, markers: set[str]) -> bool:
    names = set(re.findall(r"[A-Za-z_]\w*", expression)) - {"and", "or", "not"}
    return eval(expression, {}, {name: name in markers for name in names})  # noqa: S307 (our own script)


def test_the_full_tier_lists_no_e2e_module_by_name():
    assert "test_e2e_" not in TEST_SH
    assert len(shard_expressions()) >= 2


def test_the_ci_tier_is_every_e2e_test_not_marked_full():
    assert '-m "e2e and not full"' in TEST_SH


@pytest.mark.parametrize("path", E2E_MODULES, ids=lambda p: p.name)
def test_every_e2e_module_is_marked_and_lands_in_exactly_one_shard(path):
    markers = module_markers(path)
    assert "e2e" in markers, f"{path.name}: pytestmark lacks pytest.mark.e2e"
    assert sum(selects(e, markers) for e in shard_expressions()) == 1, (path.name, markers)


def test_selects_reads_marker_expressions():
    assert selects("e2e and not own_cluster", {"e2e", "full"})
    assert not selects("e2e and own_cluster", {"e2e", "full"})
    assert not selects("e2e and not own_cluster", set())
