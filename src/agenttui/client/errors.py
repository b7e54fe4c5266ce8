"""What the API client raises: an answer the API refused (by status), an unreachable daemon, a
certificate that is not the pinned one; and `describe`, the one-line reason for a status bar.
"""

from __future__ import annotations

import contextlib
import email.utils
from collections.abc import Mapping
from datetime import UTC, datetime
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
        self.retry_after: float | None = None  # seconds the server asked to wait (Retry-After)


class Unauthorized(ApiError):
    """401: the token is missing, unknown or revoked."""


class NotFound(ApiError):
    """404: no such object in this account (other accounts' objects are 404s too)."""


class Conflict(ApiError):
    """409: busy conversation (on_busy=reject), an Idempotency-Key reused differently, nothing
    to retry, a turn still active, a message that cannot be forked from."""


class Unavailable(ApiError):
    """The daemon could not be reached, or answered 502/503/504: worth retrying."""


class RateLimited(ApiError):
    """429: over a limit for now (too many streams, a full queue); `retry_after` says when to
    try again. Worth retrying, after that wait."""


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
    kind = {401: Unauthorized, 404: NotFound, 409: Conflict,
            429: RateLimited}.get(response.status_code)
    if kind is None:
        kind = Unavailable if response.status_code in RETRYABLE_STATUS else ApiError
    error = kind(response.status_code, code, message, details)
    error.retry_after = retry_after(response.headers.get("retry-after"))
    return error


def retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds from now (it is either seconds or an HTTP date)."""
    if not value:
        return None
    with contextlib.suppress(ValueError):
        return max(0.0, float(value.strip()))
    with contextlib.suppress(TypeError, ValueError, IndexError):
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, (when - datetime.now(UTC)).total_seconds())
    return None


def outcome_unknown(exc: ApiError) -> bool:
    """Whether a POST that failed with `exc` may still have been carried out: the daemon was
    reached (or may have been) but its answer was lost or was a server error. A refusal (4xx) or
    a certificate that is not the pinned one means nothing was done."""
    if isinstance(exc, CertificateMismatch):
        return False
    return isinstance(exc, Unavailable) or exc.status == 0 or exc.status >= 500


def describe(exc: BaseException) -> str:
    """A one-line reason for a connection problem, fit for a status bar."""
    if isinstance(exc, ApiError):
        return exc.message
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


class BadCursor(Exception):
    """The server refused a stream's cursor: start over from a fresh snapshot."""
