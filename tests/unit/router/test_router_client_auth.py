"""The router's client port as SGLang's: --api-key (Bearer, 401, the same exempt paths as
SGLang's own decide_request_auth), TLS from --ssl-certfile/--ssl-keyfile, and the backends'
--api-key sent by the router (--backend-api-key). Real aiohttp app on fake backends."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import ssl

import aiohttp
import pytest

from tests.support.fake_backends import Fakes, serve_app, truth
from tests.support.pki import make_ca, make_leaf, needs_openssl
from tests.support.flow_scenarios import flow_config

from sglang_pdd.router.front import client_auth
from sglang_pdd.router.front.app import Router, backend_session, build_app
from sglang_pdd.router.front.cli import parse_args
from sglang_pdd.router.backends.pools import Pools
from sglang_pdd.router.backends.servers import MainBackend, PrefillBackend

API_KEY = "client-key-0123456789"
ROUTER_ARGV = ["--prefill", "http://p:1,8998", "--relay", "http://r:1", "--tokenizer-path", "m"]


@contextlib.asynccontextmanager
async def front(state=None, api_key=None, ssl_ctx=None, backend_ssl=None):
    fakes = await Fakes(ssl_context=backend_ssl).start()
    pools = Pools([PrefillBackend(fakes.p_url, 8998)], [fakes.rld_url],
                  [MainBackend(fakes.md_url, fakes.md_url, "127.0.0.1:1")])
    router = Router(pools, flow_config(), None, max_prompt_tokens=1000, served_model="tiny", sglang_state=state,
                    max_new_tokens_cap=64)
    try:
        async with serve_app(client_auth.install(build_app(router), api_key), ssl_ctx) as base, \
                aiohttp.ClientSession() as client:
            yield base, client, fakes
    finally:
        await fakes.stop()


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


def sglang_allows(method, path, header) -> bool:
    """SGLang's own check, but for /health_generate: SGLang's server exempts every /health*
    path, the router guards that one as any request (it runs one on the backends)."""
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    if path == "/health_generate":
        path = "/generate"
    if header is not None and not header.isascii() and not path.startswith(("/health", "/metrics")) \
            and method != "OPTIONS":
        return False  # SGLang's compare_digest raises on non-ASCII str (a 500); a mismatch here

    return decide_request_auth(method=method, path=path, authorization_header=header, api_key=API_KEY,
                               admin_api_key=None, auth_level=AuthLevel.NORMAL).allowed


CASES = [(method, path, header)
         for method, path in [("POST", "/generate"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                              ("GET", "/v1/models"), ("GET", "/model_info"), ("GET", "/server_info"),
                              ("POST", "/flush_cache"), ("POST", "/abort_request"), ("GET", "/health"),
                              ("GET", "/health_generate"), ("GET", "/metrics"), ("OPTIONS", "/generate")]
         for header in [None, f"Bearer {API_KEY}", f"bearer {API_KEY}", "Bearer wrong", API_KEY,
                        f"Basic {API_KEY}", f"Bearer  {API_KEY}", "Bearer \u00e9t\u00e9"]]


def test_health_generate_needs_the_api_key(router_sglang_state):
    """/health_generate runs a real request (one token through P and RLD): open like SGLang's
    /health* paths, it let anyone make the backends work (50 calls: 150 backend calls). With
    --api-key it needs the key; /health stays open."""

    async def main():
        async with front(router_sglang_state, api_key=API_KEY) as (base, client, fakes):
            for _ in range(5):
                async with client.get(f"{base}/health_generate") as r:
                    assert r.status == 401 and await r.json() == {"error": "Unauthorized"}
            background = ("health", "kv_senders")  # the router's probes and its P hosts for MD
            assert [rec for rec in fakes.log if rec.kind not in background] == []  # no backend saw a request
            async with client.get(f"{base}/health") as r:
                assert r.status == 200
            async with client.get(f"{base}/health_generate", headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                assert r.status == 200
            assert sorted((rec.server, rec.kind) for rec in fakes.log if rec.kind == "generate") == [
                ("p", "generate"), ("rld", "generate")]

    run(main())


def test_health_generate_asks_nothing_of_md(router_sglang_state):
    """/health_generate checks that the router can serve (a P and an RLD): it runs on P and RLD
    only; it used to register a room on MD (and release it) on every call."""

    async def main():
        async with front(router_sglang_state) as (base, client, fakes):
            for _ in range(3):
                async with client.get(f"{base}/health_generate") as r:
                    assert r.status == 200
            background = ("health", "kv_senders")
            assert [rec.kind for rec in fakes.log if rec.server == "md" and rec.kind not in background] == []
            assert len(fakes.records("rld", "generate")) == 3

    run(main())


def test_api_key_guards_the_same_routes_with_the_same_reply_as_sglang(router_sglang_state):
    """Every (route, Authorization) pair: refused exactly when SGLang's own check refuses it,
    with SGLang's 401 body; a refused request reaches no backend."""

    async def main():
        async with front(router_sglang_state, api_key=API_KEY) as (base, client, fakes):
            for method, path, header in CASES:
                headers = {"Authorization": header} if header is not None else {}
                body = b'{"rid": "x"}' if path == "/abort_request" else b"{}"
                async with client.request(method, base + path, headers=headers,
                                          data=body if method == "POST" else None) as r:
                    got = (r.status, await r.read())
                if sglang_allows(method, path, header):
                    assert got[0] != 401, (method, path, header, got)
                else:
                    assert got[0] == 401 and (await r.json()) == {"error": "Unauthorized"}, (method, path, header)
            refused_generate = [a for a in fakes.authorization if a[1] == "/generate"]
            assert all(a[2] is None for a in fakes.authorization)  # no backend key configured
            async with client.post(f"{base}/generate", json={"input_ids": [1, 2, 3]}) as r:
                assert r.status == 401
            assert [a for a in fakes.authorization if a[1] == "/generate"] == refused_generate
            async with client.post(f"{base}/generate", headers={"Authorization": f"Bearer {API_KEY}"},
                                   json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}) as r:
                assert r.status == 200 and (await r.json())["output_ids"] == truth([1, 2, 3], 4)

    run(main())


def test_without_api_key_nothing_is_required(router_sglang_state):
    async def main():
        async with front(router_sglang_state) as (base, client, _):
            async with client.get(f"{base}/v1/models") as r:
                assert r.status == 200

    run(main())


@pytest.fixture
def backend_key():
    client_auth.use_backend_api_key("backend-key-0123456789")
    yield "backend-key-0123456789"
    client_auth.use_backend_api_key(None)


def test_backend_api_key_is_sent_to_every_backend(router_sglang_state, backend_key):
    async def main():
        async with front(router_sglang_state) as (base, client, fakes):
            async with client.post(f"{base}/generate",
                                   json={"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 4}}) as r:
                assert r.status == 200 and (await r.json())["output_ids"] == truth([4, 5, 6], 4)
            servers = {url for url, path, _ in fakes.authorization}
            assert servers == {fakes.p_url, fakes.rld_url, fakes.md_url}  # P's, RLD's and MD's legs
            assert {auth for _, _, auth in fakes.authorization} == {f"Bearer {backend_key}"}
            # a control call's own signature header replaces the session's Bearer, not joins it
            fakes.authorization.clear()
            async with backend_session() as session:
                async with session.get(f"{fakes.md_url}/pdd/stats",
                                       headers={"Authorization": "PDD-HMAC-SHA256 ts=1,nonce=2,sig=3"}):
                    pass
            assert [a[2] for a in fakes.authorization] == ["PDD-HMAC-SHA256 ts=1,nonce=2,sig=3"]

    run(main())


# ---------------------------------------------------------------------------- TLS


def self_signed(tmp_path, key_mode=0o600):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdd-router-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "router.pem", tmp_path / "router.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT, key_mode)
    os.fchmod(fd, key_mode)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_tls_serves_https_with_the_api_key_and_refuses_plain_http(tmp_path):
    pytest.importorskip("cryptography")
    cert, key = self_signed(tmp_path)
    args = parse_args(ROUTER_ARGV + ["--ssl-certfile", cert, "--ssl-keyfile", key, "--api-key", API_KEY])
    server_ctx = client_auth.ssl_context(args)
    trust = ssl.create_default_context(cafile=cert)

    async def main():
        async with front(api_key=args.api_key, ssl_ctx=server_ctx) as (base, client, _):
            assert base.startswith("https://")
            async with client.get(f"{base}/health", ssl=trust) as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
            async with client.post(f"{base}/generate", json={}, ssl=trust) as r:
                assert r.status == 401  # the key is checked inside TLS too
            async with client.post(f"{base}/generate", json={}, ssl=trust,
                                   headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                assert r.status != 401
            with pytest.raises(aiohttp.ClientError):  # an unverified certificate is refused by a client
                async with client.get(f"{base}/health"):
                    pass
            with pytest.raises(aiohttp.ClientError):  # plain HTTP to the TLS port gets no HTTP answer
                async with client.get(base.replace("https://", "http://") + "/health"):
                    pass

    run(main())


def test_tls_flags_are_checked_as_sglang_checks_them(tmp_path):
    pytest.importorskip("cryptography")
    cert, key = self_signed(tmp_path)

    def error(*flags):
        with pytest.raises(SystemExit) as e:
            client_auth.ssl_context(parse_args(ROUTER_ARGV + list(flags)))
        return str(e.value)

    assert "--ssl-certfile requires --ssl-keyfile" in error("--ssl-certfile", cert)
    assert "--ssl-keyfile requires --ssl-certfile" in error("--ssl-keyfile", key)
    assert "--ssl-keyfile-password has no effect" in error("--ssl-keyfile-password", "x")
    assert "file not found" in error("--ssl-certfile", cert, "--ssl-keyfile", str(tmp_path / "none"))
    os.chmod(key, 0o644)
    assert "--ssl-keyfile" in error("--ssl-certfile", cert, "--ssl-keyfile", key) and "chmod 600" in error(
        "--ssl-certfile", cert, "--ssl-keyfile", key)
    assert client_auth.ssl_context(parse_args(ROUTER_ARGV)) is None
    args = parse_args(ROUTER_ARGV + ["--api-key", "k", "--backend-api-key", "b"])
    assert (args.api_key, args.backend_api_key) == ("k", "b")


# ---------------------------------------------------------------------------- https backends


@needs_openssl
def test_https_backends_are_verified_against_the_backend_ca_file(router_sglang_state, tmp_path):
    """P, RLD and MD on SGLang's --ssl-certfile: with --backend-ca-file the router serves through
    them; without it (a private CA is not in the system's store) no request reaches them."""
    ca = make_ca(tmp_path, "backend-ca")
    cert, key = make_leaf(tmp_path, "backend", "backend-ca", "IP:127.0.0.1")
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 4}}

    async def main(ca_file):
        client_auth.use_backend_ca(ca_file)
        try:
            async with front(router_sglang_state, backend_ssl=served) as (base, client, fakes):
                assert fakes.p_url.startswith("https://")
                async with client.post(f"{base}/generate", json=body) as r:
                    return r.status, await r.json(), {path for _, path, _ in fakes.authorization}
        finally:
            client_auth.use_backend_ca(None)

    status, reply, paths = asyncio.run(asyncio.wait_for(main(ca), 60))
    assert status == 200 and reply["output_ids"] == truth([4, 5, 6], 4)
    assert "/generate" in paths
    status, reply, paths = asyncio.run(asyncio.wait_for(main(None), 60))
    assert status >= 500 and "/generate" not in paths, (status, reply, paths)


def test_backend_ca_file_that_cannot_be_read_stops_the_router(tmp_path):
    with pytest.raises(SystemExit, match="--backend-ca-file"):
        client_auth.use_backend_ca(str(tmp_path / "missing.pem"))
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(SystemExit, match="--backend-ca-file"):
        client_auth.use_backend_ca(str(bad))
    assert client_auth.backend_ssl() is None


def test_api_keys_come_from_private_files(tmp_path):
    """--api-key-file / --backend-api-key-file: the keys off the command line (which every
    local user can read), from files only their owner may access, as every key file."""
    from sglang_pdd.router.front.cli import parse_args

    base = ["--tokenizer-path", "m", "--relay", "http://r:1", "--prefill", "http://p:1,10"]
    client, backend = tmp_path / "client.key", tmp_path / "backend.key"
    client.write_text("client-key-0123456789\n")
    backend.write_text("backend-key-0123456789")
    for f in (client, backend):
        f.chmod(0o600)
    args = parse_args(base + ["--api-key-file", str(client), "--backend-api-key-file", str(backend)])
    assert client_auth.resolve_secrets(args, {}) == []  # nothing on argv: no warning
    assert (args.api_key, args.backend_api_key) == ("client-key-0123456789", "backend-key-0123456789")
    assert client_auth.secrets_for_workers(args) == {}  # a worker reads the files itself
    client.chmod(0o644)
    with pytest.raises(SystemExit, match="--api-key-file.*chmod 600"):
        client_auth.resolve_secrets(parse_args(base + ["--api-key-file", str(client)]), {})
    with pytest.raises(SystemExit, match="not both"):
        client_auth.resolve_secrets(parse_args(base + ["--backend-api-key", "k", "--backend-api-key-file",
                                                       str(backend)]), {})
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(SystemExit, match="empty"):
        client_auth.resolve_secrets(parse_args(base + ["--api-key-file", str(empty)]), {})
