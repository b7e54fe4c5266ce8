"""Every failure becomes JSON `{error: {code, message}}` with the right status; never a traceback.

Database unavailability is a 503 the client may retry, and so is a statement that lost a race with
other transactions (a deadlock's victim, or PostgreSQL's internal multixact error: queue.lost_race),
which rolled back whole; anything unexpected is logged with its traceback and answered with a
generic 500 body.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import asyncpg
from aiohttp import http_exceptions, web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.typedefs import Handler
from aiohttp.web_request import BaseRequest

from agentd.api import RUNTIME
from agentd.api.sse import OPEN_STREAM
from agentd.db import UNAVAILABLE
from agentd.limits import Throttled
from agentd.queue import lost_race
from agentd.service import ServiceError

log = logging.getLogger("agentd.api")

_UNAVAILABLE = (*UNAVAILABLE, asyncpg.exceptions.QueryCanceledError,
                asyncpg.exceptions.LockNotAvailableError)

# Unavailable by the look of it, but also what a fault of ours or asyncpg's raises.
_MAYBE_A_FAULT = (asyncpg.InternalClientError, asyncpg.exceptions.ProtocolViolationError)
_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 409: "conflict", 413: "payload_too_large",
               415: "unsupported_media_type", 422: "unprocessable", 429: "too_many_requests",
               431: "request_head_too_large", 500: "internal", 503: "unavailable",
               504: "timeout"}


def error_response(status: int, code: str, message: str,
                   headers: dict[str, str] | None = None, **details: Any) -> web.Response:
    body: dict[str, Any] = {"code": code, "message": message}
    if details:
        body.update(details)
    return web.json_response({"error": body}, status=status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except Exception as exc:
        stream: web.StreamResponse | None = request.get(OPEN_STREAM)
        if stream is None:
            return _answer(request, exc)
        # The status line is long sent: end the stream (the client resumes by its cursor)
        # instead of writing a second response into its body.
        if not isinstance(exc, ConnectionResetError):
            log.warning("stream ended by an error", exc_info=exc,
                        extra={"path": request.path})
        return stream


def _answer(request: web.Request, exc: Exception) -> web.StreamResponse:
    if isinstance(exc, ServiceError):
        headers = {"Retry-After": str(exc.retry_after_s)} \
            if exc.retry_after_s is not None else None
        if exc.status == 429:
            _count_throttled(request, exc.code)
        return error_response(exc.status, exc.code, exc.message, headers=headers,
                              **exc.details)
    if isinstance(exc, Throttled):
        _count_throttled(request, exc.code)
        return error_response(429, exc.code, exc.message,
                              headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        code = _HTTP_CODES.get(exc.status, "http_error")
        message = exc.reason if exc.status != 413 else "request body is too large"
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return error_response(exc.status, code, message, headers=headers or None)
    if isinstance(exc, _UNAVAILABLE):
        # Those may be faults as well as outages: their traceback goes to the log, so a fault
        # is never only a 503.
        log.warning("database unavailable", extra={"path": request.path, "error": str(exc)},
                    exc_info=exc if isinstance(exc, _MAYBE_A_FAULT) else None)
        return error_response(503, "unavailable", "the database is unavailable; retry shortly",
                              headers={"Retry-After": "1"})
    if lost_race(exc):
        # Posts run again on their own (service.Service.create_run); any other write that meets
        # the race wrote nothing, and the client sends it again.
        log.warning("a request lost a race with other transactions; nothing was written",
                    extra={"path": request.path, "error": str(exc)})
        return error_response(503, "unavailable", "the request met concurrent writes and "
                              "nothing was written; retry shortly", headers={"Retry-After": "1"})
    log.error("unhandled error", exc_info=exc, extra={"path": request.path})
    return error_response(500, "internal", "internal error")


def _count_throttled(request: web.Request, reason: str) -> None:
    """Every 429, by its code: what an operator alerts on when limits start to bite."""
    runtime = request.app.get(RUNTIME)
    if runtime is not None:
        runtime.metrics.throttled.labels(reason=reason).inc()


_REASON_CHARS = 200  # of a malformed request's reason in the log line
# aiohttp's error for a method that is no HTTP method, which aiohttp releases before 3.11.8 do
# not have (they raise BadHttpMessage, logged as any other then).
_BAD_METHOD: tuple[type[Exception], ...] = tuple(
    filter(None, [getattr(http_exceptions, "BadHttpMethod", None)]))


class JsonErrorRequestHandler(web.RequestHandler):
    """aiohttp's protocol, answering what it refuses before any handler runs — a request head
    it cannot parse, a request line or header over its limits — with the JSON error envelope
    instead of its text/plain answer quoting the parser. The middleware above never sees these:
    aiohttp answers them from `handle_error`, which this overrides (it offers no other hook)."""

    __slots__ = ()

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            # A fault of ours: logged with its traceback, as aiohttp does.
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            # A client's malformed request, which anyone can send: one line without a
            # traceback (aiohttp logs a traceback for each), its reason cut short. A method
            # that is no HTTP method is what TLS or a scanner sent to this port: debug, as
            # aiohttp logs it.
            level = logging.DEBUG if isinstance(exc, _BAD_METHOD) else logging.WARNING
            log.log(level, "refused a request that is not valid HTTP",
                    extra={"remote": request.remote, "status": status,
                           "error": str(exc or message or "")[:_REASON_CHARS]})
        if request.writer.output_size > 0:
            # As aiohttp's own: an answer already begun cannot be followed by another.
            raise ConnectionError("Response is sent already, cannot send another response "
                                  "with the error message")
        if isinstance(exc, LineTooLong) or (
                isinstance(exc, BadHttpMessage) and exc.message.startswith("Too many headers")):
            answer = error_response(
                431, _HTTP_CODES[431], f"the request head is too large: at most "
                f"{max(self.max_line_size, self.max_field_size)} bytes in the request line and "
                f"in each header, and at most {self.max_headers} headers")
        elif status == 400:
            answer = error_response(400, _HTTP_CODES[400], "the request is not valid HTTP")
        elif status == 500:
            answer = error_response(500, _HTTP_CODES[500], "internal error")
        else:
            answer = error_response(status, _HTTP_CODES.get(status, "http_error"),
                                    HTTPStatus(status).phrase.lower())
        answer.force_close()  # the connection's framing is lost: it ends with this answer
        return answer


def json_error_handlers(server: web.Server) -> Callable[[], web.RequestHandler]:
    """A protocol factory for `server` (a GuardedSite's) whose handlers answer in JSON."""

    def make() -> web.RequestHandler:
        handler = server()
        # Built by aiohttp with every setting the runner gave it (none of which we repeat),
        # then given the subclass that only overrides handle_error: same slots, same state.
        handler.__class__ = JsonErrorRequestHandler
        return handler

    return make
