"""The import map of sglang_pdd: which module imports which, checked against the layers below.

Reads the package's source (the AST, nothing is imported or run) and finds every import of
an ``sglang_pdd`` module, at the top of a module or inside a function ("lazy": it still ties
the two modules together, it only runs later). Then:

* cycles: strongly connected groups of modules, and of packages (a package here is a
  subpackage such as ``router`` or a top-level module such as ``config``);
* upward imports: a package importing one in a higher layer than its own.

    python scripts/import_map.py            # report; exit 1 on a cycle or an upward import
    python scripts/import_map.py --write    # also rewrite the map in docs/architecture.md

tests/unit/repo/test_import_map.py runs the same analysis, so a new cycle or upward import fails CI.
Starting another process (``python -m sglang_pdd.router`` from the launcher) is not an import
and is not counted.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "sglang_pdd"
DOC = REPO / "docs" / "architecture.md"
BEGIN, END = "<!-- import_map: begin (scripts/import_map.py --write) -->", "<!-- import_map: end -->"

# Lowest first. A package may import its own layer's packages and lower ones, never higher.
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    ("foundation",
     ("sglang_pdd", "machine", "log_text", "shared_key", "admission", "protocol", "control"),
     "pure and stdlib-near: the state machine kit, client strings as a log line takes them, the shared key's bound, signed control calls, who may connect before "
     "authenticating, the control protocol (routes, messages, its one error type), the gate every "
     "control server runs behind and the one shape of a control server on it (control/)"),
    ("mechanisms",
     ("kv_channel", "handoff", "radix_drc"),
     "no SGLang import: the KV channels (wire, handshake, WAN sender and receiver, intra-DC engine), handoff "
     "policy and stitching, MD's room bookkeeping (over kv_channel's layouts)"),
    ("flags",
     ("config",),
     "the --pdd-* server flags, parsed and validated into the mechanisms' settings (the KV "
     "acceptor's admission limits); pure, no SGLang import"),
    ("services",
     ("sglang_glue", "router"),
     "the two programs: the plugin inside SGLang's processes (P, RLD, MD) and the router in front "
     "of them; they talk over HTTP (neither imports the other today)"),
    ("tools",
     ("sim", "launcher", "chaos"),
     "built on the services: the simulator reuses the router's policy and placement, the launcher "
     "starts the servers, the WAN emulator and the router, chaos fires faults at that cluster under load and checks "
     "what it answered"),
]


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, dotted
    dst: str  # imported module, dotted
    line: int
    lazy: bool  # inside a function: runs when it is called, not at import


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """``sglang_pdd.router.flow.pdd_flow`` -> ``router``; ``sglang_pdd.config`` -> ``config``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_index() -> dict[str, int]:
    return {pkg: i for i, (_, pkgs, _) in enumerate(LAYERS) for pkg in pkgs}


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: set[str]):
        self.module, self.modules = module, modules
        self.here = module if is_package else module.rpartition(".")[0]  # base of relative imports
        self.depth = 0
        self.edges: list[Edge] = []

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _add(self, target: str, line: int) -> None:
        while target and target not in self.modules:  # a name in a module: the module
            target = target.rpartition(".")[0]
        if target and target != self.module:
            self.edges.append(Edge(self.module, target, line, self.depth > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == PACKAGE:
                self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.here.split(".")
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] != PACKAGE:
            return
        for alias in node.names:  # ``from pkg import submodule`` imports the submodule
            name = f"{source}.{alias.name}"
            self._add(name if name in self.modules else source, node.lineno)


def scan(root: Path) -> tuple[set[str], list[Edge]]:
    """All modules under the package directory ``root`` and the imports between them."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    edges: list[Edge] = []
    for name, path in files.items():
        visitor = _Imports(name, path.name == "__init__.py", modules)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        edges.extend(visitor.edges)
    return modules, sorted(set(edges), key=lambda e: (e.src, e.dst, e.line))


def find_cycles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node, and nodes importing themselves
    (Tarjan's algorithm, iterative). Each group sorted; groups sorted."""
    nodes = set(graph) | {d for ds in graph.values() for d in ds}
    succ = {n: sorted(set(graph.get(n, ()))) for n in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(succ[node]):
                work.append((node, i + 1))
                nxt = succ[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1 or node in succ[node]:
                    groups.append(sorted(group))
    return sorted(groups)


def graph_of(edges: Iterable[Edge], key=lambda m: m) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for e in edges:
        src, dst = key(e.src), key(e.dst)
        if src != dst:
            out.setdefault(src, set()).add(dst)
    return out


def upward_imports(edges: Iterable[Edge], layers: Optional[dict[str, int]] = None) -> list[Edge]:
    """Imports from a package into a higher layer's."""
    layers = layer_index() if layers is None else layers
    return [e for e in edges if layers[package_of(e.dst)] > layers[package_of(e.src)]]


def unlayered(modules: Iterable[str], layers: Optional[dict[str, int]] = None) -> list[str]:
    """Packages in no layer (a new one must be placed in LAYERS)."""
    layers = layer_index() if layers is None else layers
    return sorted({package_of(m) for m in modules} - set(layers))


@dataclass
class Report:
    modules: set[str]
    edges: list[Edge]
    module_cycles: list[list[str]]
    package_cycles: list[list[str]]
    upward: list[Edge]
    unlayered: list[str]

    @property
    def ok(self) -> bool:
        return not (self.module_cycles or self.package_cycles or self.upward or self.unlayered)


def analyse(root: Path = REPO / PACKAGE) -> Report:
    modules, edges = scan(root)
    missing = unlayered(modules)
    return Report(modules, edges, find_cycles(graph_of(edges)), find_cycles(graph_of(edges, package_of)),
                  [] if missing else upward_imports(edges), missing)


def mermaid(edges: list[Edge]) -> str:
    """Packages grouped by layer, lowest at the bottom; a dotted arrow: only lazy imports."""
    lazy_only: dict[tuple[str, str], bool] = {}
    for e in edges:
        pair = (package_of(e.src), package_of(e.dst))
        if pair[0] != pair[1]:
            lazy_only[pair] = lazy_only.get(pair, True) and e.lazy
    lines = ["```mermaid", "flowchart BT"]
    for name, pkgs, _ in reversed(LAYERS):
        lines.append(f"  subgraph {name}")
        lines.extend(f"    {p}" for p in pkgs)
        lines.append("  end")
    for (src, dst), lazy in sorted(lazy_only.items()):
        lines.append(f"  {src} {'-.->' if lazy else '-->'} {dst}")
    lines.append("```")
    return "\n".join(lines)


def doc_section(report: Report) -> str:
    rows = ["| layer | packages | what |", "| --- | --- | --- |"]
    for i, (name, pkgs, what) in enumerate(LAYERS):
        rows.append(f"| {i} {name} | {', '.join(f'`{p}`' for p in pkgs)} | {what} |")
    return "\n".join([BEGIN, "", mermaid(report.edges), "", *rows, "", END])


def write_doc(report: Report, doc: Path = DOC) -> bool:
    """Replace the generated section of docs/architecture.md; True when it changed."""
    text = doc.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    new = head + doc_section(report) + tail
    if new != text:
        doc.write_text(new)
    return new != text


def doc_is_current(report: Report, doc: Path = DOC) -> bool:
    return doc_section(report) in doc.read_text()


def describe(report: Report) -> str:
    lazy = sum(e.lazy for e in report.edges)
    out = [f"{len(report.modules)} modules, {len(report.edges)} imports between them ({lazy} lazy)",
           f"module cycles: {len(report.module_cycles)}", *(f"  {' <-> '.join(c)}" for c in report.module_cycles),
           f"package cycles: {len(report.package_cycles)}", *(f"  {' <-> '.join(c)}" for c in report.package_cycles),
           f"upward imports: {len(report.upward)}",
           *(f"  {e.src}:{e.line} -> {e.dst}{' (lazy)' if e.lazy else ''}" for e in report.upward)]
    if report.unlayered:
        out.append(f"packages in no layer (add them to LAYERS): {', '.join(report.unlayered)}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"rewrite the map in {DOC.relative_to(REPO)}")
    args = ap.parse_args(argv)
    report = analyse()
    print(describe(report))
    if args.write:
        print(f"{DOC.relative_to(REPO)}: {'rewritten' if write_doc(report) else 'already current'}")
    elif not doc_is_current(report):
        print(f"{DOC.relative_to(REPO)} is out of date: run python scripts/import_map.py --write")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
