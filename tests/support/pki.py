"""Test certificates, made at test time with the openssl CLI (no key material in the repository):
CAs and leaves signed by them, each key file 0600 as sglang-pdd requires of private keys."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

# scripts/setup.sh installs openssl; under scripts/test.sh (CI set) a missing one fails, not skips
needs_openssl = pytest.mark.skipif(not shutil.which("openssl") and not os.environ.get("CI"),
                                   reason="openssl CLI needed to make test certificates")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=cwd)


def make_ca(d: Path, name: str) -> str:
    """A self-signed CA ``name``; returns its certificate's path (its key: ``name``.key)."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)
    return str(d / f"{name}.pem")


def make_leaf(d: Path, name: str, ca: str, san: str) -> tuple[str, str]:
    """A leaf ``name`` signed by CA ``ca`` (its name, as given to make_ca) with subjectAltName
    ``san`` (e.g. ``IP:127.0.0.1``); returns (certificate path, key path)."""
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    os.chmod(d / f"{name}.key", 0o600)
    return str(d / f"{name}.pem"), str(d / f"{name}.key")
