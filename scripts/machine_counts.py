"""How uniform the package's state machines and names are: a few counts over the source (AST).

    python scripts/machine_counts.py

Counts (nothing is imported or run):
* state machines: modules of sglang_pdd/ with a top-level ``transition`` (a function, or one
  built by the machine kit ``sglang_pdd/machine.py``), each with its dispatch style: ``kit``
  (the kit's table), ``table`` (a hand-written ``_HANDLERS`` table) or ``isinstance`` (a chain
  of isinstance tests on the event);
* the exception classes those modules raise (illegal events), with their bases where the
  package defines them;
* state written outside a transition: assignments to an attribute ``state`` / ``phase`` in
  sglang_pdd/ whose value is not a machine's answer (a lifecycle that never got a machine);
* helpers in tests/ that fold events through a transition function (a loop calling it);
* class names defined in more than one module of sglang_pdd/;
* class names containing "room" / "leg" (how many things each word names), and the holder
  chains ``.rooms.rooms``;
* control servers: ``ControlApi`` subclasses (sglang_pdd/control/api.py's one shape) and
  request-handler classes of their own (a subclass of control_gate's handler outside control_gate
  and control_api, or one built with ``type()``), and functions routing by an ``if ... .path == "/..."`` chain;
* typed paths into MD's runtime: room commands named by a string (``.call("register", ...)``,
  ``.submit("release", ...)``, ``op == "register"``) and places that default
  ``max_new_tokens`` (``.get("max_new_tokens", default)``, ``"max_new_tokens" not in ...``);
* methods of the largest classes (``Router``, ``PddTokenizerManager``, ``Simulation``);
* the import map (scripts/import_map.py): module and package cycles, upward imports.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import import_map  # noqa: E402

PACKAGE = REPO / "sglang_pdd"
BUILTIN_BASES = {"Exception", "ValueError", "RuntimeError", "TypeError", "KeyError", "ConnectionError"}


def _modules(root: Path):
    for path in sorted(root.rglob("*.py")):
        yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text())


def _top_transition(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "transition":
            return node
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "transition" for t in targets):
                return node
    return None


def _dispatch_style(tree: ast.Module, node: ast.AST) -> str:
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        return "kit"
    if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance"
           for n in ast.walk(node)):
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if "_HANDLERS" not in names:
            return "isinstance"
    return "table"


def _raised(tree: ast.Module) -> set[str]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Raise) and n.exc is not None:
            e = n.exc.func if isinstance(n.exc, ast.Call) else n.exc
            if isinstance(e, ast.Name):
                out.add(e.id)
            elif isinstance(e, ast.Attribute):
                out.add(e.attr)
        if isinstance(n, ast.FunctionDef) and n.returns is not None:  # helpers building the error to raise
            r = n.returns
            if isinstance(r, ast.Name) and (r.id.endswith("Error") or r.id.startswith("Illegal")):
                out.add(r.id)
    out.discard("_illegal")
    return out


def _classes(trees) -> dict[str, list[tuple[str, list[str]]]]:
    out = defaultdict(list)
    for rel, tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "?") for b in n.bases]
                out[n.name].append((rel, bases))
    return out


def _machine_answer(value: ast.AST) -> bool:
    """A machine's answer, a new machine's first state (a class called) or none yet."""
    if isinstance(value, ast.Constant) and value.value is None:
        return True
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "_"))[:1].isupper():
        return True
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) in
               ("transition", "fold", "_step", "step") for n in ast.walk(value))


def _state_writes(rel: str, tree: ast.Module) -> list[str]:
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and not _machine_answer(n.value):
            for t in n.targets:
                elts = t.elts if isinstance(t, ast.Tuple) else [t]
                if any(isinstance(e, ast.Attribute) and e.attr in ("state", "phase") for e in elts):
                    out.append(f"{rel}:{n.lineno}")
    return out


def _fold_helpers(rel: str, tree: ast.Module) -> list[str]:
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef) and not n.name.startswith("test_"):
            for loop in (x for x in ast.walk(n) if isinstance(x, ast.For)):
                calls = {getattr(c.func, "id", getattr(c.func, "attr", "")) for c in ast.walk(loop)
                         if isinstance(c, ast.Call)}
                if "transition" in calls or (n.args.args and n.args.args[0].arg in calls):
                    out.append(f"{rel}:{n.name}")
                    break
    return out


def _words(name: str) -> set[str]:
    """``AbortSendRooms`` -> {abort, send, room}; ``RoomsFull`` -> {room, full}."""
    return {w.lower().rstrip("s") if w.lower() != "s" else w for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+", name)}


def _control_servers(package) -> tuple[list[str], list[str], list[str]]:
    """(ControlApi subclasses, handler classes of their own, functions routing by an
    ``if ... .path == "/..." ... else`` chain)."""
    apis, handlers, chains = [], [], []
    for rel, tree in package:
        own_module = rel in ("sglang_pdd/control/gate.py", "sglang_pdd/control/api.py")
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in n.bases}
                if "ControlApi" in bases:
                    apis.append(f"{rel}:{n.name}")
                if "JsonRequestHandler" in bases and not own_module:
                    handlers.append(f"{rel}:{n.name}")
            elif (isinstance(n, ast.Call) and getattr(n.func, "id", "") == "type" and len(n.args) == 3
                  and not own_module and isinstance(n.args[1], ast.Tuple)
                  and any(getattr(e, "id", "").endswith("Handler") for e in n.args[1].elts)):
                handlers.append(f"{rel}:{n.lineno} (type())")
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    isinstance(i, ast.If) and isinstance(i.test, ast.Compare)
                    and getattr(i.test.left, "attr", "") == "path"
                    and isinstance(i.test.comparators[0], ast.Constant)
                    and str(i.test.comparators[0].value)[:1] == "/" and i.orelse for i in ast.walk(n)):
                chains.append(f"{rel}:{n.name}")
    return apis, handlers, chains


def _string_commands(package) -> list[str]:
    """MD room commands named by a string: ``.call("register", ...)``, ``op == "release"``."""
    out = []
    for rel, tree in package:
        if not rel.startswith("sglang_pdd/sglang_glue/"):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and getattr(n.func, "attr", "") in ("call", "submit") and n.args \
                    and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
                out.append(f"{rel}:{n.lineno}")
            elif isinstance(n, ast.Compare) and getattr(n.left, "id", "") == "op" \
                    and isinstance(n.comparators[0], ast.Constant):
                out.append(f"{rel}:{n.lineno}")
    return out


def _max_new_defaults(package) -> list[str]:
    out = []
    for rel, tree in package:
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "get" and len(n.args) == 2 \
                    and isinstance(n.args[0], ast.Constant) and n.args[0].value == "max_new_tokens":
                out.append(f"{rel}:{n.lineno}")
            elif isinstance(n, ast.Compare) and isinstance(n.left, ast.Constant) and n.left.value == "max_new_tokens" \
                    and isinstance(n.ops[0], ast.NotIn):
                out.append(f"{rel}:{n.lineno}")
    return out


def _methods(package, names) -> dict[str, int]:
    out = {}
    for _, tree in package:
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef) and n.name in names:
                out[n.name] = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in n.body)
    return out


def main() -> int:
    package = list(_modules(PACKAGE))
    tests = list(_modules(REPO / "tests"))
    classes = _classes(package)

    machines, errors, writes = [], defaultdict(set), []
    machine_modules = set()
    for rel, tree in package:
        node = _top_transition(tree)
        if node is not None:
            machine_modules.add(rel)
            machines.append((rel, _dispatch_style(tree, node)))
            for name in _raised(tree):
                errors[name].add(rel)
    for rel, tree in package:
        if rel not in machine_modules:
            writes += _state_writes(rel, tree)

    styles = defaultdict(int)
    for _, style in machines:
        styles[style] += 1
    print(f"state machines: {len(machines)}  (" + ", ".join(f"{k} {v}" for k, v in sorted(styles.items())) + ")")
    for rel, style in machines:
        print(f"    {rel}: {style}")
    illegal = {n for n in errors if n not in ("TypeError",)}
    print(f"exception classes raised by machine modules: {len(illegal)}  " + "; ".join(
        f"{n}({', '.join(b for _, bs in classes.get(n, []) for b in bs) or 'builtin'})" for n in sorted(illegal)))
    print(f"state written outside a transition: {len(writes)}  {' '.join(writes)}")
    folds = [h for rel, tree in tests for h in _fold_helpers(rel, tree)]
    print(f"fold helpers in tests/: {len(folds)}  {' '.join(folds)}")

    dup = {name: where for name, where in classes.items() if len({rel for rel, _ in where}) > 1}
    print(f"class names defined in more than one module: {len(dup)}  " + "; ".join(
        f"{n} ({', '.join(rel for rel, _ in w)})" for n, w in sorted(dup.items())))
    for word in ("room", "leg"):
        named = sorted({n for n in classes if word in _words(n)})
        print(f"class names with the word '{word}': {len(named)}  {' '.join(named)}")
    chains = [f"{rel}:{n.lineno}" for rel, tree in package for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and n.attr == "rooms"
              and isinstance(n.value, ast.Attribute) and n.value.attr == "rooms"]
    print(f"'.rooms.rooms' chains: {len(chains)}")

    apis, handlers, path_chains = _control_servers(package)
    print(f"control servers: ControlApi {len(apis)}, handler classes of their own {len(handlers)}, "
          f"path if-chains {len(path_chains)}  {' '.join(apis + handlers + path_chains)}")
    commands = _string_commands(package)
    print(f"MD room commands named by a string: {len(commands)}  {' '.join(commands)}")
    defaults = _max_new_defaults(package)
    print(f"places defaulting max_new_tokens: {len(defaults)}  {' '.join(defaults)}")
    methods = _methods(package, ("Router", "PddTokenizerManager", "Simulation"))
    print("methods: " + ", ".join(f"{name} {n}" for name, n in sorted(methods.items())))

    report = import_map.analyse()
    print(f"import map: module cycles {len(report.module_cycles)}, package cycles {len(report.package_cycles)}, "
          f"upward imports {len(report.upward)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
