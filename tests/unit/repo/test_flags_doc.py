"""docs/flags.md is generated from the flags' definitions (scripts/gen_flags_doc.py): it is current,
it names every flag, its table cells cannot break, and the roles it prints agree with validate()."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re

import pytest

from tests.conftest import REPO_ROOT
from sglang_pdd.config import FLAGS, ROLES, PddConfig, PddConfigError, add_pdd_args, validate

_spec = importlib.util.spec_from_file_location("gen_flags_doc", REPO_ROOT / "scripts" / "gen_flags_doc.py")
gen_flags_doc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_flags_doc)


@pytest.fixture(scope="module")
def doc() -> str:
    return gen_flags_doc.DOC.read_text()


def _flag_rows(doc: str) -> dict[str, str]:
    """Each table row of the doc by its flag (the first word of its first cell)."""
    return {m.group(1): line for line in doc.splitlines() if (m := re.match(r"\| `(--[a-z0-9-]+)", line))}


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]


def test_docs_flags_md_is_what_the_generator_writes_now(doc):
    assert doc == gen_flags_doc.render(), "docs/flags.md is stale: run `python scripts/gen_flags_doc.py`"


def test_every_flag_config_py_registers_has_a_row_with_its_default_and_roles(doc):
    parser = argparse.ArgumentParser()
    add_pdd_args(parser)
    registered = [a for a in parser._actions if any(s.startswith("--pdd-") for s in a.option_strings)]
    assert len(registered) == len(FLAGS) > 20
    rows = _flag_rows(doc)
    by_flag = {f.flag: f for f in FLAGS}
    for action in registered:
        flag = action.option_strings[0]
        assert flag in rows, f"{flag} is registered but not in docs/flags.md"
        shown, default, roles, meaning = _cells(rows[flag])
        assert roles == by_flag[flag].roles
        assert meaning and meaning in action.help.replace("*", "\\*")  # --help = "roles: " + the table's text
        if action.default not in (None, False, ""):
            assert str(action.default) in default, flag


def test_every_router_flag_has_a_row(doc):
    from sglang_pdd.router.front.cli import build_parser

    rows = _flag_rows(doc)
    visible = [a.option_strings[0] for a in build_parser()._actions
               if a.option_strings and a.help is not argparse.SUPPRESS and a.option_strings[0] != "-h"]
    assert len(visible) > 40
    assert [f for f in visible if f not in rows] == []
    assert "--reuse-port" not in rows  # internal (each worker's), hidden from --help and the doc


def test_a_pipe_in_help_text_does_not_split_the_row():
    row = f"| {gen_flags_doc.cell('--x {a|b}', code=True)} | {gen_flags_doc.cell('a | b, *all* of it')} |"
    assert _cells(row) == ["`--x {a\\|b}`", "a \\| b, \\*all\\* of it"]


def _valid(role: str) -> PddConfig:
    return {"prefill": PddConfig(role="prefill", wan_key_file="k"),
            "relay": PddConfig(role="relay"),
            "main": PddConfig(role="main", wan_listen="10.0.0.1:1", control_listen="10.0.0.1:2",
                              wan_key_file="k")}[role]


_MODE = {"prefill": "prefill", "relay": "decode", "main": "null"}
_ONLY = [(f, other) for f in FLAGS if f.roles.endswith(" only") for other in ROLES if other != f.roles.split()[0]]


def _other_value(flag) -> object:
    kwargs = flag.kwargs
    if "choices" in kwargs:
        return next(c for c in kwargs["choices"] if c != kwargs["default"])
    if kwargs.get("type") in (int, float):
        return kwargs["default"] + 1
    return "10.0.0.9:1"


@pytest.mark.parametrize("flag,other", _ONLY, ids=[f"{f.flag}-on-{o}" for f, o in _ONLY])
def test_a_flag_the_doc_says_is_one_roles_only_is_refused_on_the_others(flag, other):
    assert len(_ONLY) >= 10
    base = _valid(other)
    validate(base, _MODE[other])  # the role is fine without the flag
    cfg = dataclasses.replace(base, **{flag.dest[len("pdd_"):]: _other_value(flag)})
    with pytest.raises(PddConfigError, match=re.escape(flag.flag)):
        validate(cfg, _MODE[other])


def test_the_role_rule_the_doc_prints_is_the_one_validate_applies(doc):
    """--pdd-role's SGLang modes are one table (config.REQUIRED_DISAGG_MODE): the doc's words
    come from it, and validate() accepts each role in its mode only, with the pdd backend
    exactly where the table puts the role in a disaggregation mode."""
    from sglang_pdd.config import REQUIRED_DISAGG_MODE, role_rule
    assert role_rule() in _flag_rows(doc)["--pdd-role"]
    for role, mode in REQUIRED_DISAGG_MODE.items():
        assert (f"{role} needs --disaggregation-mode {mode}" in role_rule() or f"{role} --disaggregation-mode "
                f"{mode}" in role_rule()) if mode != "null" else f"{role} neither" in role_rule()
        backend = "pdd" if mode != "null" else "mooncake"  # SGLang's own for a role outside PD
        for given in ("prefill", "decode", "null"):
            if given == mode:
                validate(_valid(role), given, backend)
            else:
                with pytest.raises(PddConfigError, match=f"--pdd-role {role} needs"):
                    validate(_valid(role), given, backend)
        if mode != "null":
            with pytest.raises(PddConfigError, match="--disaggregation-transfer-backend pdd"):
                validate(_valid(role), mode, transfer_backend="mooncake")
