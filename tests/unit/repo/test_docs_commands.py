"""The commands the docs and the benchmarks' docstrings give (``python -m benchmarks.NAME ...``,
``python -m sglang_pdd.sim ...``, ``python -m sglang_pdd.chaos ...``, ...) name only options
their module takes. Running them is the smoke tier's (tests/unit/benchmarks/test_bench_smoke.py,
tests/e2e/test_e2e_bench_smoke.py) at the smallest honest size; the sizes written in the docs
take minutes to hours on a quiet machine, so no test runs them as written. docs/sim-notebook.md
is left out: a lab notebook, its commands are the record of what ran then, with that day's
options."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

SOURCES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")),
           *sorted((REPO_ROOT / "benchmarks").glob("*.py"))]
NOT_CHECKED = {"sim-notebook.md"}
OURS = ("benchmarks.", "sglang_pdd.")
COMMAND = re.compile(r"(?:\.venv/bin/)?python -m ((?:benchmarks|sglang_pdd)\.[a-z_][a-z0-9_.]*)(?![\w])([^`\n#]*)")


def doc_commands() -> list[tuple[str, str, str, list[str]]]:
    """(where, module, subcommand or "", options) of every command naming one of our modules."""
    out = []
    for path in SOURCES:
        if path.name in NOT_CHECKED:
            continue
        text = path.read_text().replace("\\\n", " ")
        for m in COMMAND.finditer(text):
            module, rest = m.group(1), m.group(2)
            words = rest.split()
            sub = words[0] if words and re.fullmatch(r"[a-z][a-z0-9-]*", words[0]) else ""
            out.append((f"{path.relative_to(REPO_ROOT)}: python -m {module}{rest.rstrip()}", module, sub,
                        re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)))
    return out


COMMANDS = doc_commands()

# One process prints every module's (and subcommand's) --help: imports are paid once.
_HELP = r"""
import contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")
out = {}
for module, sub in json.loads(sys.argv[1]):
    sys.argv = [module] + ([sub] if sub else []) + ["--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except Exception as e:  # noqa: BLE001
        rc, buf = 1, io.StringIO(repr(e))
    out[module + " " + sub] = [rc, buf.getvalue()]
print("\n" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict:
    wanted = sorted({(module, sub) for _, module, sub, _ in COMMANDS} | {(module, "") for _, module, _, _ in COMMANDS})
    done = subprocess.run([sys.executable, "-c", _HELP, json.dumps(wanted)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def module_source(module: str) -> str:
    path = REPO_ROOT / Path(*module.split("."))
    files = [path.with_suffix(".py")] if path.with_suffix(".py").exists() else sorted(path.glob("*.py"))
    return "".join(f.read_text() for f in files)


def test_the_docs_give_commands_of_each_kind():
    modules = {module for _, module, _, _ in COMMANDS}
    assert {"sglang_pdd.sim", "sglang_pdd.chaos", "benchmarks.bench_handoff", "benchmarks.bench_agentic"} <= modules
    assert len(COMMANDS) > 60


@pytest.mark.parametrize("where,module,sub,options", COMMANDS, ids=[c[0][:120] for c in COMMANDS])
def test_a_documented_command_names_options_its_module_takes(where, module, sub, options, helps):
    rc, text = helps[f"{module} {sub}"]
    if rc != 0:  # not a subcommand: the module's own options
        rc, text = helps[f"{module} "]
    assert rc == 0, f"{module} --help failed: {text[-500:]}"
    source = module_source(module)  # options a script reads before argparse (e.g. sim_report --markdown)
    unknown = [o for o in options if not re.search(re.escape(o) + r"(?![\w-])", text) and f'"{o}"' not in source]
    assert not unknown, f"{where}\n  options {module} does not take: {unknown}"
