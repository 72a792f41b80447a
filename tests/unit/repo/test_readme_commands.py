"""The commands the README tells a user to run, run or parsed here (the demo runs in
tests/e2e/test_e2e_demo.py, the test command is CI itself)."""

from __future__ import annotations

import re
import shlex
import subprocess

from tests.conftest import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
TEST_SH = (REPO_ROOT / "scripts" / "test.sh").read_text()


def readme_command(prefix: str) -> list[str]:
    """The README's command line starting with ``prefix`` (backslash continuations joined)."""
    text = README.replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.strip().startswith(prefix))
    return shlex.split(line.split("#")[0])


def test_the_readmes_router_command_parses(tmp_path):
    from sglang_pdd.router.front.cli import parse_args

    argv = readme_command("python -m sglang_pdd.router")[3:]
    args = parse_args([tmp_path.name if a == "M" else a for a in argv])
    assert args.chat_template == "chatml" and len(args.prefill) == 1 and len(args.main) == 1
    assert args.control_key_file == "/etc/pdd/wan.key" and args.operator_token_file == "/etc/pdd/operator.token"


def test_the_router_help_the_readme_points_to():
    done = subprocess.run([str(REPO_ROOT / ".venv" / "bin" / "python"), "-m", "sglang_pdd.router", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0 and "--handoff-mode" in done.stdout and "--operator-token-file" in done.stdout


def test_readme_test_commands_use_flags_test_sh_knows():
    for command in re.findall(r"`(bash scripts/test\.sh[^`]*)`", README):
        flags = [w for w in shlex.split(command)[2:] if w.startswith("--")]
        assert all(flag in ("--full",) for flag in flags), command


def test_a_filter_that_selects_only_unit_tests_passes_the_test_command():
    """``bash scripts/test.sh -k NAME`` (README): the e2e stage then selects nothing (pytest's
    exit 5), which must not fail the command."""
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "test.sh"), "-k", "test_one_shot_handoff_emits_each_token_once"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "(no test selected in this stage)" in done.stdout and "minutes per stage" in done.stdout
