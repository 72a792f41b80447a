"""How scattered the router <-> P/MD control contract is: a few counts over the source (AST).

    python scripts/structure_counts.py

Counts, over sglang_pdd/, tests/ and benchmarks/ (docstrings excluded):
* files with a string literal holding a ``/pdd/`` path (the control API's routes, and the
  router's own /pdd/backends);
* files with a quoted ``pdd_[a-z_]+`` key, all such keys and only the control keys (the leg
  parameters and the resume marker), incl. ``pdd_*=`` keyword arguments;
* assignments defining ``RESUME_KEY`` / ``MAX_MD_TP``;
* the md_tp range check: a chained comparison ``1 <= X <= Y`` where X or Y names md_tp / MAX_MD_TP;
* the error classes the control servers turn into HTTP statuses (raised or caught there);
* HTTP statuses chosen from an error's text (``"..." in str(e)``, ``str(e).startswith(...)`` in sglang_pdd/; tests may
  look at the text).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("sglang_pdd", "tests", "benchmarks")
KEY = re.compile(r"pdd_[a-z_]+")
CONTROL_KEYS = {"pdd_room", "pdd_wan_peer", "pdd_md_prefix_len", "pdd_md_tp", "pdd_wan_expected",
                "pdd_resume_output_len"}
BOUNDARY_ERRORS = {"HttpError", "DestinationError", "RoomError", "ControlError"}
# the modules serving the control APIs (and their test fakes)
SERVERS = ("sglang_pdd/control/gate.py", "sglang_pdd/sglang_glue/md/main_drc.py", "sglang_pdd/sglang_glue/p/prefill_control.py",
           "sglang_pdd/protocol", "tests/support/fake_backends.py", "tests/support/control_fakes.py")


def _files():
    for root in ROOTS:
        yield from sorted((REPO / root).rglob("*.py"))


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
           {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _by_root(files: list[str]) -> str:
    return ", ".join(f"{root}/ {sum(f.startswith(root + '/') for f in files)}" for root in ROOTS)


def main() -> None:
    path_files, key_files, control_key_files = [], [], []
    definitions = {"RESUME_KEY": [], "MAX_MD_TP": []}
    range_checks, text_status = [], []
    boundary: dict[str, set[str]] = {}
    for path in _files():
        rel = path.relative_to(REPO).as_posix()
        source = path.read_text()
        tree = ast.parse(source)
        docs = _docstrings(tree)
        strings = [n.value for n in ast.walk(tree)
                   if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]
        keys = {s for s in strings if KEY.fullmatch(s)}
        keys |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg and KEY.fullmatch(n.arg)}
        if any("/pdd/" in s for s in strings):
            path_files.append(rel)
        if keys:
            key_files.append(rel)
        if keys & CONTROL_KEYS:
            control_key_files.append(rel)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and t.id in definitions:
                        definitions[t.id].append(f"{rel}:{node.lineno}")
            if (isinstance(node, ast.Compare) and len(node.ops) == 2
                    and all(isinstance(op, (ast.LtE, ast.Lt)) for op in node.ops)
                    and isinstance(node.left, ast.Constant) and node.left.value == 1):
                named = {s.lower() for s in _names(node)}
                if any("md_tp" in s for s in named) or (
                        "size" in named and any("limit" in s or "md_tp" in s for s in named)):
                    range_checks.append(f"{rel}:{node.lineno}")
            if (rel.startswith("sglang_pdd/") and isinstance(node, ast.Compare)
                    and any(isinstance(op, ast.In) for op in node.ops)
                    and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "str"
                            for c in node.comparators)):
                text_status.append(f"{rel}:{node.lineno}")
            if (rel.startswith("sglang_pdd/") and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("startswith", "endswith") and isinstance(node.func.value, ast.Call)
                    and isinstance(node.func.value.func, ast.Name) and node.func.value.func.id == "str"
                    and [getattr(a, "id", None) for a in node.func.value.args] in (["e"], ["exc"], ["error"])):
                text_status.append(f"{rel}:{node.lineno}")
        if rel.startswith(SERVERS):
            for node in ast.walk(tree):
                exprs = []
                if isinstance(node, ast.Raise) and node.exc is not None:
                    exprs.append(node.exc)
                if isinstance(node, ast.ExceptHandler) and node.type is not None:
                    exprs.append(node.type)
                for e in exprs:
                    for name in _names(e) & BOUNDARY_ERRORS:
                        boundary.setdefault(name, set()).add(rel)

    print(f"files with a /pdd/ path literal: {len(path_files)} ({_by_root(path_files)})")
    for f in path_files:
        print(f"    {f}")
    print(f"files with a quoted pdd_* key: {len(key_files)} ({_by_root(key_files)}); "
          f"control keys only: {len(control_key_files)} ({_by_root(control_key_files)})")
    for f in control_key_files:
        print(f"    {f}")
    for name, where in definitions.items():
        print(f"definitions of {name}: {len(where)}  {' '.join(where)}")
    print(f"md_tp range checks: {len(range_checks)}  {' '.join(range_checks)}")
    print(f"error classes at the control boundary: {len(boundary)}  "
          + "; ".join(f"{k} ({', '.join(sorted(v))})" for k, v in sorted(boundary.items())))
    print(f"statuses chosen from str(e): {len(text_status)}  {' '.join(text_status)}")


if __name__ == "__main__":
    main()
