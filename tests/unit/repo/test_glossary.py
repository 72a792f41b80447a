"""The glossary (docs/architecture.md#glossary) holds for the package's class names: a class
named for one of its pinned nouns (room, leg) is named in it, and every state machine names
its state, its phase and its error the one way. A new class that bears "room" or "leg" is
either one of those things (and the glossary says so) or wants another name."""

from __future__ import annotations

import ast
import re

import pytest

from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "sglang_pdd"
# The nouns whose every class the glossary lists: each names one thing only.
PINNED = ("room", "leg")


def _classes() -> dict[str, str]:
    """Public class name -> the module (relative path) defining it."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                out[node.name] = path.relative_to(REPO_ROOT).as_posix()
    return out


def _glossary() -> str:
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    start = text.index("## Glossary")
    return text[start:text.index("\n## ", start + 1) if "\n## " in text[start + 1:] else len(text)]


def _words(name: str) -> set[str]:
    """``AbortSendRooms`` -> {abort, send, room}."""
    return {w.lower().removesuffix("s") for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+", name)}


@pytest.mark.parametrize("noun", PINNED)
def test_every_class_named_for_a_pinned_noun_is_in_the_glossary(noun):
    named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", _glossary()))
    missing = sorted(f"{name} ({where})" for name, where in _classes().items()
                     if noun in _words(name) and name not in named)
    assert not missing, f"classes named '{noun}' that docs/architecture.md#glossary does not name: {missing}"


def test_the_glossary_names_no_class_that_is_gone():
    classes = _classes()
    named = {n for n in re.findall(r"`([A-Z][A-Za-z0-9]*)`", _glossary()) if any(w in _words(n) for w in PINNED)}
    assert sorted(named - set(classes)) == []


def _machines() -> dict[str, ast.Module]:
    """Modules with a kit-built ``transition`` (``transition = table_machine(...)``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "transition" for t in node.targets)
                    and getattr(node.value.func, "id", "") == "table_machine"):
                out[path.relative_to(REPO_ROOT).as_posix()] = tree
    return out


def test_every_machine_names_its_state_phase_and_error_one_way():
    """``<Noun>State`` (the frozen state), ``<Noun>Phase`` (where it is; the KV rooms keep
    SGLang's numbering, ``RoomState``) and ``Illegal<Noun>Event`` (its error)."""
    assert len(_machines()) == 8
    odd = []
    for rel, tree in _machines().items():
        classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
        errors = [c for c in classes if c.startswith("Illegal")]
        if not (len(errors) == 1 and re.fullmatch(r"Illegal[A-Z][a-z]+Event", errors[0])):
            odd.append(f"{rel}: error {errors}")
            continue
        noun = errors[0][len("Illegal"):-len("Event")]
        if f"{noun}State" not in classes:
            odd.append(f"{rel}: no {noun}State")
        phases = [c for c in classes if c.endswith("Phase")]
        if phases not in ([f"{noun}Phase"], []):
            odd.append(f"{rel}: phases {phases}")
    assert not odd, odd
