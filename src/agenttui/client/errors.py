"""What the API client raises: an answer the API refused (by status), an unreachable daemon, a
certificate that is not the pinned one; and `describe`, the one-line reason for a status bar.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import httpx

from agenttui.pinning import certificate_changed

RETRYABLE_STATUS = frozenset({502, 503, 504})


class ApiError(Exception):
    """An answer the API refused: HTTP status (0 when the server was not reached), code, text."""

    def __init__(self, status: int, code: str, message: str,
                 details: Mapping[str, Any] | None = None) -> None:
        super().__init__(f"{message} ({code}, HTTP {status})" if status else message)
        self.status = status
        self.code = code
        self.message = message
        self.details = dict(details or {})


class Unauthorized(ApiError):
    """401: the token is missing, unknown or revoked."""


class NotFound(ApiError):
    """404: no such object in this account (other accounts' objects are 404s too)."""


class Conflict(ApiError):
    """409: busy conversation (on_busy=reject), an Idempotency-Key reused differently, nothing
    to retry, a turn still active, a message that cannot be forked from."""


class Unavailable(ApiError):
    """The daemon could not be reached, or answered 502/503/504: worth retrying."""


class CertificateMismatch(ApiError):
    """The server's certificate is not the pinned one: refused, and never retried."""

    def __init__(self, url: str, pinned: str, presented: str) -> None:
        super().__init__(0, "certificate_changed", (
            f"{url} presented certificate {presented}, but this device pinned {pinned}: "
            "refusing to connect. If the server's certificate was replaced on purpose "
            "(`agentd pair` on the server shows the current one), re-pin with: "
            f"agenttui login {url} --fingerprint {presented}"))
        self.pinned = pinned
        self.presented = presented


def transport_error(url: str, exc: Exception, what: str) -> ApiError:
    changed = certificate_changed(exc)
    if changed is not None:
        return CertificateMismatch(url, changed.pinned, changed.presented)
    return Unavailable(0, "unreachable", what)


def error_from_response(response: httpx.Response) -> ApiError:
    code, message, details = "http_error", response.reason_phrase or "error", {}
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        body = response.json()["error"]
        code = str(body.get("code", code))
        message = str(body.get("message", message))
        details = {k: v for k, v in body.items() if k not in ("code", "message")}
    kind = {401: Unauthorized, 404: NotFound, 409: Conflict}.get(response.status_code)
    if kind is None:
        kind = Unavailable if response.status_code in RETRYABLE_STATUS else ApiError
    return kind(response.status_code, code, message, details)


def describe(exc: BaseException) -> str:
    """A one-line reason for a connection problem, fit for a status bar."""
    if isinstance(exc, ApiError):
        return exc.message
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


class BadCursor(Exception):
    """The server refused a stream's cursor: start over from a fresh snapshot."""
