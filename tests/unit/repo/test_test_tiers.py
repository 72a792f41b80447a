"""scripts/test.sh selects end-to-end modules by marker, never by a hand-kept list: every module
in tests/e2e/ carries the e2e marker and lands in exactly one shard of the full tier, no test in
tests/unit/ carries it, and every test module sits in one of the two."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

TESTS = REPO_ROOT / "tests"
TEST_SH = (REPO_ROOT / "scripts" / "test.sh").read_text()
E2E_MODULES = sorted((TESTS / "e2e").glob("test_*.py"))
UNIT_MODULES = sorted((TESTS / "unit").rglob("test_*.py"))


def marks_anywhere(path: Path) -> set[str]:
    """Every ``pytest.mark.NAME`` a module names: its ``pytestmark``, decorators, parameters."""
    return {n.attr for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}


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


def test_no_unit_module_marks_a_test_e2e():
    """An e2e test (real servers, minutes) belongs in tests/e2e/, where the shards above see it."""
    assert len(UNIT_MODULES) > 50
    marked = [str(p.relative_to(TESTS)) for p in UNIT_MODULES if "e2e" in marks_anywhere(p)]
    assert not marked, f"e2e tests under tests/unit/ (move them to tests/e2e/): {marked}"


def test_every_test_module_is_in_unit_or_e2e():
    """A new test goes in tests/unit/<package>/ (or tests/unit/ for sglang_pdd's top-level
    modules) or tests/e2e/ (docs/testing.md); support/ holds no tests."""
    stray = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
             if p.relative_to(TESTS).parts[0] not in ("unit", "e2e")]
    assert not stray, f"test modules outside tests/unit/ and tests/e2e/: {stray}"


def test_every_test_folder_is_a_package():
    """Packages (an __init__.py in every folder) let two folders hold modules of the same name."""
    folders = {p.parent for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts}
    assert not [str(f.relative_to(REPO_ROOT)) for f in folders if not (f / "__init__.py").exists()]


def imports_of_test_modules(path: Path) -> list[str]:
    """The modules under tests/unit or tests/e2e that ``path`` imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found += [n for n in names if n.startswith(("tests.unit", "tests.e2e"))]
    return found


def test_no_test_module_imports_another(tmp_path):
    """What several tests share lives in tests/support/, never in a test module that others
    import (and benchmarks import support/, never a test)."""
    files = [p for p in list(TESTS.rglob("*.py")) + list((REPO_ROOT / "benchmarks").rglob("*.py"))
             if "__pycache__" not in p.parts]
    found = {str(p.relative_to(REPO_ROOT)): imports_of_test_modules(p) for p in files}
    assert not {f: mods for f, mods in found.items() if mods}
    probe = tmp_path / "probe.py"  # the check itself sees such an import, in either form
    probe.write_text("import tests.e2e.test_e2e_pdd\nfrom tests.unit.router.test_lifecycle import fold\n")
    assert imports_of_test_modules(probe) == ["tests.e2e.test_e2e_pdd", "tests.unit.router.test_lifecycle"]
