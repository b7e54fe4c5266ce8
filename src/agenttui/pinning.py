"""Pinned servers: TLS to agentd trusted by the certificate's fingerprint, checked on every
connection the client opens (API calls, `ask`, streams, reconnects).

The pin is checked inside the handshake of each new connection (an SSLObject subclass), so no
pooled connection, retry or reconnect can skip it, and a connection is only ever reused after
passing it. Redirects are never followed (AgentClient), so none can lead elsewhere. A CA chain is
not required: agentd's certificate is usually self-signed, and the pin is stronger than a CA.
No Textual here.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

from agentd.fingerprints import fingerprint, matches, normalize


class CertificateChanged(ssl.SSLCertVerificationError):
    """The server presented another certificate than the pinned one."""

    def __init__(self, pinned: str, presented: str) -> None:
        super().__init__(f"certificate {presented} is not the pinned {pinned}")
        self.pinned = pinned
        self.presented = presented


class _PinnedSSLObject(ssl.SSLObject):
    """An SSL connection that fails its handshake unless the peer's certificate is the pin."""

    def do_handshake(self) -> None:
        super().do_handshake()
        context = self.context
        pinned = getattr(context, "pinned", None)
        if pinned is None:  # a context without a pin never gets this class
            raise ssl.SSLError("agenttui: a pinned context lost its pin")
        der = self.getpeercert(binary_form=True)
        if der is None or not matches(der, pinned):
            raise CertificateChanged(pinned, fingerprint(der) if der else "no certificate")


class _PinnedContext(ssl.SSLContext):
    pinned: str


def pinned_context(pin: str) -> ssl.SSLContext:
    """A client context that accepts exactly the certificate `pin` names (TLS 1.2 or newer)."""
    context = _PinnedContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # The pin replaces CA and host-name checks: it names one certificate, whoever signed it.
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.pinned = normalize(pin)
    context.sslobject_class = _PinnedSSLObject
    return context


def certificate_changed(exc: BaseException) -> CertificateChanged | None:
    """The pin failure somewhere in an exception's chain (httpx wraps it twice), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, CertificateChanged):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


async def server_fingerprint(url: str, *, timeout: float = 10.0) -> str:  # noqa: ASYNC109
    """The fingerprint of the certificate an https:// server presents (trust on first use).

    Nothing is sent but the handshake: the caller shows the fingerprint, the user confirms it,
    and only then does a pinned connection carry a code or a token.
    """
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise ValueError(f"{url} is not an https:// URL")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    async with asyncio.timeout(timeout):
        _reader, writer = await asyncio.open_connection(
            parts.hostname, parts.port or 443, ssl=context, server_hostname=parts.hostname)
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (OSError, ssl.SSLError):
            pass
    if not der:
        raise ssl.SSLError(f"{url} presented no certificate")
    return fingerprint(der)
