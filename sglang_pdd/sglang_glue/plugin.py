"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``pdd``).

SGLang calls ``register()`` in every one of its processes before building ServerArgs or a
Scheduler. It only registers HookRegistry hooks, so importing sglang_pdd alone changes nothing,
and a server started without --pdd-role behaves exactly like plain SGLang.
"""

from __future__ import annotations

import logging

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_pdd.config import PddConfigError, add_pdd_args, config_from_namespace, validate

logger = logging.getLogger(__name__)

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"


def _add_cli_args(original, parser):
    original(parser)
    add_pdd_args(parser)


def _attach_pdd_config(server_args, cls, args):
    """After ServerArgs.from_cli_args: validate the --pdd-* flags and keep them on the record."""
    cfg = config_from_namespace(args)
    try:
        validate(cfg, str(getattr(server_args, "disaggregation_mode", "null")))
    except PddConfigError as e:
        # argparse-style failure: one clear line, exit code 2, before any process is spawned.
        raise SystemExit(f"sglang-pdd: error: {e}") from None
    server_args._pdd_config = cfg
    if cfg.active:
        logger.info("sglang-pdd active: role=%s datacenter=%s", cfg.role, cfg.datacenter or "-")
    return server_args


def get_pdd_config(server_args):
    """The PddConfig a server was started with (inactive default when the flags were not used)."""
    from sglang_pdd.config import PddConfig

    return getattr(server_args, "_pdd_config", None) or PddConfig()


def register() -> None:
    HookRegistry.register(f"{_SERVER_ARGS}.add_cli_args", _add_cli_args, HookType.AROUND)
    HookRegistry.register(f"{_SERVER_ARGS}.from_cli_args", _attach_pdd_config, HookType.AFTER)
