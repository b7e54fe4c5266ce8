"""agenttui's pinned TLS against real servers on real sockets: exactly the pinned certificate,
checked at every new connection, so neither a pooled client nor a redirect gets around it."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from agentd import tls
from agentd.settings import Settings
from agenttui.client import AgentClient, ApiError, CertificateMismatch
from agenttui.pinning import pinned_context, server_fingerprint
from tests.support.daemon import free_port

ME = {"account": "alice", "account_id": "00000000-0000-0000-0000-000000000001",
      "device": "laptop", "device_id": "00000000-0000-0000-0000-000000000002"}


def certificate(root: Path) -> tls.ServerCertificate:
    return tls.server_certificate(Settings(data_dir=root, tls="on"))


@asynccontextmanager
async def serving(cert: tls.ServerCertificate, port: int,
                  handler: Callable[[web.Request], web.StreamResponse] | None = None,
                  ) -> AsyncIterator[list[str]]:
    """An HTTPS server presenting `cert` on `port`; yields the paths it was asked for."""
    asked: list[str] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        asked.append(request.path)
        return handler(request) if handler else web.json_response(ME)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls.server_context(cert)).start()
    try:
        yield asked
    finally:
        await runner.cleanup()


async def test_only_the_pinned_certificate_and_at_every_new_connection(tmp_path: Path) -> None:
    pinned, other = certificate(tmp_path / "a"), certificate(tmp_path / "b")
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    async with AgentClient(url, "agd_t", fingerprint=pinned.fingerprint,
                           trust_env=False) as client:
        async with serving(pinned, port) as asked:
            assert await server_fingerprint(url) == pinned.fingerprint
            assert (await client.me()).device == "laptop"
            assert (await client.me()).device == "laptop"  # a pooled connection, checked once
            assert asked == ["/v1/me", "/v1/me"]
        async with serving(other, port) as asked:
            with pytest.raises(CertificateMismatch) as caught:
                await client.me()  # the same client: its next connection meets the new cert
            assert asked == []  # nothing reached the server: not even the request line
        assert caught.value.pinned == pinned.fingerprint
        assert caught.value.presented == other.fingerprint
        message = caught.value.message
        assert pinned.fingerprint in message and other.fingerprint in message
        assert f"agenttui login {url} --fingerprint {other.fingerprint}" in message


async def test_a_scheme_in_capitals_is_pinned_all_the_same(tmp_path: Path) -> None:
    """`HTTPS://` is https: the pin holds (it was dropped, the client then trusting any
    certificate a CA had signed)."""
    pinned, other = certificate(tmp_path / "a"), certificate(tmp_path / "b")
    port = free_port()
    async with AgentClient(f"HTTPS://127.0.0.1:{port}/", "agd_t",
                           fingerprint=pinned.fingerprint, trust_env=False) as client:
        assert client.url == f"https://127.0.0.1:{port}"
        assert client.pinned == pinned.fingerprint
        async with serving(other, port) as asked:
            with pytest.raises(CertificateMismatch):
                await client.me()
            assert asked == []


async def test_without_a_pin_the_operating_system_trust_store_decides(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--fingerprint ca`: no pin, the system's CAs (as OpenSSL finds them: SSL_CERT_FILE
    names a bundle in its place here) and the host name are checked. httpx alone checked
    certifi's bundle, which knows nothing of a CA installed on this machine."""
    cert = certificate(tmp_path / "a")  # its own trust anchor, as `curl --cacert` takes it
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    async with serving(cert, port):
        monkeypatch.setenv("SSL_CERT_FILE", str(cert.cert_path))
        async with AgentClient(url, "agd_t", trust_env=False) as client:
            assert (await client.me()).device == "laptop"
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "no-such-bundle.pem"))
        monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "no-such-dir"))
        async with AgentClient(url, "agd_t", trust_env=False) as client:
            with pytest.raises(ApiError):
                await client.me()  # a CA this machine does not trust


async def test_a_redirect_leads_nowhere(tmp_path: Path) -> None:
    pinned, other = certificate(tmp_path / "a"), certificate(tmp_path / "b")
    port, elsewhere = free_port(), free_port()

    def redirect(_request: web.Request) -> web.StreamResponse:
        return web.Response(status=307, headers={
            "Location": f"https://127.0.0.1:{elsewhere}/v1/me"})

    async with serving(pinned, port, redirect), serving(other, elsewhere) as far_asked, \
            AgentClient(f"https://127.0.0.1:{port}", "agd_t", fingerprint=pinned.fingerprint,
                        trust_env=False) as client:
        with pytest.raises(ApiError) as caught:
            await client.me()
        assert caught.value.code == "unexpected_redirect"
        assert far_asked == []


def test_the_pinned_context_checks_no_ca_and_no_name_but_the_pin(tmp_path: Path) -> None:
    context = pinned_context(certificate(tmp_path).fingerprint)
    assert context.verify_mode == ssl.CERT_NONE and not context.check_hostname
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
