"""The package's import map (scripts/import_map.py): no cycles, no upward imports, the map in
docs/architecture.md current; and the checks themselves catch what they are for."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import REPO_ROOT

_spec = importlib.util.spec_from_file_location("import_map", REPO_ROOT / "scripts" / "import_map.py")
import_map = importlib.util.module_from_spec(_spec)
sys.modules["import_map"] = import_map  # its dataclasses look their module up there
_spec.loader.exec_module(import_map)


@pytest.fixture(scope="module")
def report():
    return import_map.analyse()


def test_every_package_has_a_layer(report):
    assert report.unlayered == []


def test_no_module_imports_itself_round_a_cycle(report):
    assert report.module_cycles == [], import_map.describe(report)


def test_no_package_imports_itself_round_a_cycle(report):
    assert report.package_cycles == [], import_map.describe(report)


def test_no_package_imports_a_higher_layer(report):
    assert report.upward == [], import_map.describe(report)


def test_the_map_in_the_docs_is_current(report):
    assert import_map.doc_is_current(report), "run: python scripts/import_map.py --write"


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert import_map.find_cycles(graph) == [["a", "b", "c"], ["e"]]
    assert import_map.find_cycles({"a": {"b"}, "b": {"c"}, "d": {"b"}}) == []


def test_two_cycles_through_one_node_are_one_group():
    assert import_map.find_cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "c"]]


def _write(root, files: dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_small_package_scanned_from_source(tmp_path):
    """Absolute, relative, ``from pkg import submodule`` and lazy imports; a cycle made by a
    lazy import still counts, and so does an upward import."""
    pkg = tmp_path / "sglang_pdd"
    _write(pkg, {
        "__init__.py": "",
        "shared_key.py": "import os\n",
        "control/auth.py": "from sglang_pdd.kv_channel.wire import X\n",  # foundation -> mechanisms
        "kv_channel/__init__.py": "",
        "kv_channel/wire.py": "from sglang_pdd import shared_key\nX = 1\n",
        "kv_channel/handshake.py": "from .wire import X\n",
        "router/__init__.py": "",
        "router/app.py": "from sglang_pdd.router.front import f\n",
        "router/front.py": "def f():\n    from sglang_pdd.router import app\n",
    })
    modules, edges = import_map.scan(pkg)
    pairs = {(e.src, e.dst, e.lazy) for e in edges}
    assert ("sglang_pdd.kv_channel.wire", "sglang_pdd.shared_key", False) in pairs
    assert ("sglang_pdd.kv_channel.handshake", "sglang_pdd.kv_channel.wire", False) in pairs
    assert ("sglang_pdd.router.front", "sglang_pdd.router.app", True) in pairs
    report = import_map.analyse(pkg)
    assert report.module_cycles == [["sglang_pdd.router.app", "sglang_pdd.router.front"]]
    assert report.package_cycles == []
    assert [(e.src, e.dst) for e in report.upward] == [("sglang_pdd.control.auth", "sglang_pdd.kv_channel.wire")]
    assert not report.ok


def test_a_package_in_no_layer_is_reported(tmp_path):
    pkg = tmp_path / "sglang_pdd"
    _write(pkg, {"__init__.py": "", "newthing/__init__.py": "", "newthing/mod.py": "from sglang_pdd import config\n",
                 "config.py": ""})
    report = import_map.analyse(pkg)
    assert report.unlayered == ["newthing"] and not report.ok
