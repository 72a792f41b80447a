"""The ``pdd`` transfer backend is reachable through SGLang's own registry (patched SGLang)."""

import pytest

from tests.conftest import require_sglang_import


def test_pdd_backend_resolves_through_sglangs_registry():
    require_sglang_import()
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVSender
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    from sglang_pdd.sglang_glue import plugin
    from sglang_pdd.sglang_glue.transfer_backend import PddKVManager, PddKVReceiver, PddKVSender

    plugin._register_transfer_backend()
    plugin._register_transfer_backend()  # idempotent: every SGLang process calls it once
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("pdd") == 1
    backend = TransferBackend("pdd")
    assert backend is TransferBackend("pdd") and backend.value == "pdd"
    assert get_kv_class(backend, KVClassType.MANAGER) is PddKVManager
    assert get_kv_class(backend, KVClassType.SENDER) is PddKVSender
    assert get_kv_class(backend, KVClassType.RECEIVER) is PddKVReceiver
    assert issubclass(PddKVManager, MooncakeKVManager) and issubclass(PddKVSender, MooncakeKVSender)
    # built-in backends are untouched; unknown names still fail as before
    assert get_kv_class(TransferBackend("mooncake"), KVClassType.MANAGER) is MooncakeKVManager
    with pytest.raises(ValueError):
        TransferBackend("no-such-backend")
