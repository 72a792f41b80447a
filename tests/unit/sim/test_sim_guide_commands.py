"""docs/sim.md's commands parse: every `python -m sglang_pdd.sim ...` and `python -m
benchmarks.*` line of its "Running it" block is handed to its own argument parser (nothing is
simulated), so a renamed flag or subcommand breaks this test, not a reader's copy-paste."""

import re
import shlex

import pytest

from benchmarks import sim_headline
from sglang_pdd.sim import cli
from tests.conftest import REPO_ROOT

GUIDE = REPO_ROOT / "docs" / "sim.md"


def _commands():
    text = open(GUIDE).read()
    block = text.split("## Running it", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    env, out, cur = {}, [], ""
    for line in block.splitlines():
        line = line.split("   #", 1)[0].rstrip()
        if cur:
            line = cur + " " + line.strip()
            cur = ""
        if line.endswith("\\"):
            cur = line[:-1]
            continue
        m = re.match(r"^(\w+)=(.*)$", line.strip())
        if m:
            env[m.group(1)] = m.group(2).strip('"')
            continue
        if line.strip().startswith("python -m "):
            out.append(re.sub(r"\$(\w+)", lambda v: env[v.group(1)], line.strip()))
    return out


COMMANDS = _commands()


def test_the_guide_has_commands_for_every_headline_subcommand_and_the_sim():
    assert len(COMMANDS) >= 10
    for sub in ("headline", "map", "placement", "staging", "table"):
        assert any(c.startswith(f"python -m benchmarks.sim_headline {sub}") for c in COMMANDS), sub
    for sub in ("size", "compare", "rld-sweep", "sweep", "bathtub", "gen-trace"):
        assert any(c.startswith(f"python -m sglang_pdd.sim {sub} ") for c in COMMANDS), sub


@pytest.mark.parametrize("command", [c for c in COMMANDS if " ... " not in c])
def test_a_guide_command_parses(command, monkeypatch):
    argv = shlex.split(command)[2:]
    module, args = argv[0], argv[1:]
    seen = []
    if module == "sglang_pdd.sim":
        for name in dir(cli):
            if name.startswith("cmd_"):
                monkeypatch.setattr(cli, name, lambda a, name=name: seen.append(name) or 0)
        assert cli.main(args) == 0
    elif module == "benchmarks.sim_headline":
        for name in ("headline", "wins_map", "placement", "staging", "table"):
            monkeypatch.setattr(sim_headline, name, lambda a, name=name: seen.append(name) or 0)
        assert sim_headline.main(args) == 0
    else:
        pytest.skip(f"{module} has no parser to check here")
    assert len(seen) == 1
