"""One default per setting: a router flag that fills a field of the flow's configuration
(router/front/cli.py's flow_config: FlowConfig, its PathPolicyConfig and HandoffConfig) defaults to
the dataclass's own default, so code that builds a FlowConfig() (tests, the simulator, a
library user) runs with what `python -m sglang_pdd.router` runs with. The simulator's flags
that stand for the router's read the same defaults."""

from __future__ import annotations

import dataclasses

from sglang_pdd.router.front.cli import build_parser, flow_config
from sglang_pdd.router.flow.pdd_flow import FlowConfig

_SETTLED_ELSEWHERE: set = set()  # pairs that may differ, each with its reason


def _leaves(value, prefix=""):
    """Every field of a (nested) dataclass as ``dotted.name -> value``."""
    if not dataclasses.is_dataclass(value):
        return {prefix[:-1]: value}
    out = {}
    for f in dataclasses.fields(value):
        out.update(_leaves(getattr(value, f.name), f"{prefix}{f.name}."))
    return out


def test_every_router_flag_defaults_to_its_flow_config_field():
    args = build_parser().parse_args(["--prefill", "http://p:1,8998", "--relay", "http://r:1",
                                      "--tokenizer-path", "t"])
    from_cli, from_code = _leaves(flow_config(args)), _leaves(FlowConfig())
    assert from_cli.keys() == from_code.keys() and len(from_cli) > 20
    differ = {name: (from_cli[name], from_code[name]) for name in from_cli
              if from_cli[name] != from_code[name] and name not in _SETTLED_ELSEWHERE}
    assert differ == {}, "CLI default vs dataclass default"


def test_the_simulators_flags_for_the_routers_settings_default_as_the_router_does():
    import argparse

    from sglang_pdd.router.policy import RLD_MAX_RUNNING_DEFAULT
    from sglang_pdd.sim.cli import _add_common
    sim = argparse.ArgumentParser()
    _add_common(sim)
    router = build_parser().parse_args(["--prefill", "http://p:1,8998", "--relay", "http://r:1",
                                        "--tokenizer-path", "t"])
    assert sim.get_default("rld_max_running") == router.rld_max_running == FlowConfig().rld_max_running \
        == RLD_MAX_RUNNING_DEFAULT
    assert sim.get_default("path_mode") == router.path_mode == FlowConfig().path.mode.value
    assert sim.get_default("catch_up_threshold") == router.catch_up_threshold \
        == FlowConfig().handoff.catch_up_threshold_tokens
