"""Key files: private to their owner and long enough, or refused with a clear error."""

import os
import secrets

import pytest

from sglang_pdd.config import PddConfig, PddConfigError
from sglang_pdd.kv_channel.handshake import MIN_KEY_BYTES, KeyFileError, check_key, load_key
from sglang_pdd.launcher.topology import write_wan_key


def _write(path, data: bytes, mode: int):
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_private_key_file_loads_stripped(tmp_path):
    key = secrets.token_hex(32).encode()
    assert load_key(_write(tmp_path / "k", key + b"\n", 0o600)) == key
    assert load_key(str(_write(tmp_path / "r", key, 0o400))) == key


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_key_file_readable_by_others_is_refused(tmp_path, mode):
    path = _write(tmp_path / "wan.key", secrets.token_hex(32).encode(), mode)
    with pytest.raises(KeyFileError) as e:
        load_key(path)
    assert str(path) in str(e.value) and f"{mode:04o}" in str(e.value) and "chmod 600" in str(e.value)


def test_short_key_is_refused(tmp_path):
    path = _write(tmp_path / "short.key", b"0123456789abcdef\n", 0o600)  # 16 bytes: was accepted before
    with pytest.raises(KeyFileError, match=rf"short.key holds a 16-byte key; need at least {MIN_KEY_BYTES}"):
        load_key(path)
    with pytest.raises(ValueError, match="at least 32 bytes"):
        check_key(b"x" * 16)


def test_missing_key_file_names_the_file(tmp_path):
    with pytest.raises(KeyFileError, match="nope.key: cannot open"):
        load_key(tmp_path / "nope.key")


def test_launcher_writes_a_private_key_that_loads(tmp_path):
    old = _write(tmp_path / "wan.key", b"old", 0o644)
    path = write_wan_key(old)  # replaces an old, world-readable file
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert len(load_key(path)) >= MIN_KEY_BYTES


def test_backend_reports_a_bad_key_file_as_a_config_error(tmp_path):
    pytest.importorskip("sglang")
    from sglang_pdd.sglang_glue.transfer_backend import read_key

    path = _write(tmp_path / "wan.key", secrets.token_hex(32).encode(), 0o644)
    with pytest.raises(PddConfigError, match="--pdd-wan-key-file: key file .*wan.key has mode 0644"):
        read_key(PddConfig(wan_key_file=str(path)))
