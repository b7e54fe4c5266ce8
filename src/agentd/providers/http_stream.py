"""One POST answered by a Server-Sent Events stream: the transport of the remote providers.

Every failure becomes a ProviderError that says what happened (HTTP status and the server's own
message, timeouts, refused connections). A rate limit before the first event is retried after
its Retry-After, a bounded number of times; once events flow nothing is retried. Leaving the
iterator early (a stop, a lost lease) closes the response, and with it the upstream connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse

from agentd.providers.base import ProviderError
from agentd.settings import ProviderConfig

log = logging.getLogger("agentd.providers")

RETRY_STATUSES = frozenset({429, 503, 529})  # rate limited, unavailable, overloaded
MAX_RETRIES = 3
MAX_RETRY_WAIT_S = 60.0
ERROR_BODY_BYTES = 4096
DETAIL_CHARS = 300
# The most text one event of an answer may hold, with the lines before it that are no event
# (comments): a whole tool call's arguments fit many times over. httpx-sse buffers a line,
# and an event's data lines, without any bound of its own.
MAX_EVENT_CHARS = 16 * 1024 * 1024


def required_base_url(config: ProviderConfig) -> str:
    """The provider's base URL; a provider without one cannot be built (model_unavailable)."""
    if not config.base_url:
        raise ProviderError(f"providers.{config.name}.base_url is not configured",
                            "model_unavailable")
    return config.base_url


def make_client(config: ProviderConfig) -> httpx.AsyncClient:
    """The provider's one shared client: connect, read, write and pool waits bounded by
    timeout_s, so a server that hangs fails the run instead of holding it forever."""
    return httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s),
                             limits=httpx.Limits(max_connections=100,
                                                 max_keepalive_connections=20),
                             follow_redirects=False)


def api_key(config: ProviderConfig) -> str | None:
    """The key, read from the environment variable the config names; never stored anywhere."""
    if not config.api_key_env:
        return None
    return os.environ.get(config.api_key_env) or None


def key_hint(config: ProviderConfig) -> str:
    if not config.api_key_env:
        return "no api_key_env is configured for this provider"
    if api_key(config) is None:
        return f"the environment variable {config.api_key_env} is not set"
    return f"check the key in the environment variable {config.api_key_env}"


def parse_event_data(config: ProviderConfig, event: ServerSentEvent) -> dict[str, Any]:
    try:
        data = json.loads(event.data)
    except ValueError:
        raise ProviderError(f"{config.name}: malformed stream event: "
                            f"{event.data[:DETAIL_CHARS]!r}") from None
    if not isinstance(data, dict):
        raise ProviderError(f"{config.name}: malformed stream event: "
                            f"{event.data[:DETAIL_CHARS]!r}")
    return data


def error_detail(payload: Any) -> str:
    """The human part of an error body in the shapes real servers send (OpenAI, Anthropic,
    Ollama, vLLM, llama.cpp): {"error": {"message", "type"}}, {"error": "text"}, or text."""
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, str):
            return error[:DETAIL_CHARS]
        if isinstance(error, dict):
            message = str(error.get("message") or error.get("detail") or "").strip()
            kind = error.get("type") or error.get("code")
            if message and kind and str(kind) not in message:
                return f"{message} ({kind})"[:DETAIL_CHARS]
            if message or kind:
                return str(message or kind)[:DETAIL_CHARS]
        if "detail" in payload:
            return str(payload["detail"])[:DETAIL_CHARS]
        return json.dumps(payload)[:DETAIL_CHARS]
    return " ".join(str(payload).split())[:DETAIL_CHARS]


def _body_detail(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    try:
        return error_detail(json.loads(text))
    except ValueError:
        return error_detail(text) or "(empty body)"


def retry_wait(headers: Mapping[str, str], attempt: int) -> float:
    """Seconds to wait before retrying: retry-after-ms, Retry-After (seconds or an HTTP date),
    else exponential backoff from one second."""
    if "retry-after-ms" in headers:
        with contextlib.suppress(ValueError):
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
    value = headers.get("retry-after")
    if value is not None:
        try:
            return max(0.0, float(value))
        except ValueError:
            with contextlib.suppress(TypeError, ValueError, IndexError):
                return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    return float(2 ** attempt)


def status_code_of(status: int) -> str:
    """The run error code for a provider's HTTP status (agentd.vocabulary.RunErrorCode)."""
    if status in (401, 403):
        return "provider_auth"
    if status == 429:
        return "provider_rate_limited"
    if status >= 500 or status in RETRY_STATUSES:
        return "provider_unavailable"
    return "provider_rejected"


def _status_message(config: ProviderConfig, model: str, response: httpx.Response,
                    detail: str) -> str:
    status = response.status_code
    head = f"{config.name}: HTTP {status} {response.reason_phrase}".rstrip()
    if status in (401, 403):
        return f"{head}: authentication failed ({key_hint(config)}): {detail}"
    if status == 404:
        return (f"{head}: not found: check the model name {model!r} and base_url "
                f"{config.base_url!r}: {detail}")
    if status == 429:
        return f"{head}: rate limited: {detail}"
    if status >= 500:
        return f"{head}: the provider failed: {detail}"
    return f"{head}: the request was rejected: {detail}"


async def post_event_stream(client: httpx.AsyncClient, config: ProviderConfig, *, url: str,
                            model: str, headers: dict[str, str],
                            body: dict[str, Any]) -> AsyncGenerator[ServerSentEvent, None]:
    """POST `body` and yield the answer's events; raises ProviderError on any failure."""
    timeout = config.timeout_s
    attempt = 0
    while True:
        wait: float | None = None
        try:
            async with aconnect_sse(client, "POST", url, headers=dict(headers),
                                    json=body) as source:
                response = source.response
                if response.status_code != 200:
                    detail = _body_detail(await _read_bounded(response))
                    message = _status_message(config, model, response, detail)
                    code = status_code_of(response.status_code)
                    if response.status_code not in RETRY_STATUSES:
                        raise ProviderError(message, code)
                    wanted = retry_wait(response.headers, attempt)
                    if wanted > MAX_RETRY_WAIT_S:
                        raise ProviderError(f"{message}; the server asks to wait {wanted:g} s, "
                                            f"longer than agentd waits ({MAX_RETRY_WAIT_S:g} s)",
                                            code)
                    if attempt >= MAX_RETRIES:
                        raise ProviderError(f"{message}; gave up after {MAX_RETRIES} retries",
                                            code)
                    wait = wanted
                else:
                    content_type = response.headers.get("content-type", "")
                    if "text/event-stream" not in content_type:
                        detail = _body_detail(await _read_bounded(response))
                        raise ProviderError(f"{config.name}: expected an event stream from "
                                            f"{url}, got {content_type or 'no content type'}: "
                                            f"{detail}")
                    since_event = _bound_text(response, config)
                    async with contextlib.aclosing(source.aiter_sse()) as events:
                        while True:
                            # The idle bound covers a server that keeps the connection alive
                            # with comments but sends no events; it never spans a yield.
                            try:
                                async with asyncio.timeout(timeout):
                                    event = await anext(events)
                            except StopAsyncIteration:
                                return
                            since_event[0] = 0
                            yield event
        except httpx.TimeoutException as exc:
            raise ProviderError(_timeout_message(config, url, exc),
                                "provider_timeout") from None
        except TimeoutError:
            raise ProviderError(f"{config.name}: timed out: no event from {_host(url)} for "
                                f"{timeout:g} s (providers.{config.name}.timeout_s)",
                                "provider_timeout") from None
        except httpx.ConnectError as exc:
            raise ProviderError(f"{config.name}: cannot connect to {config.base_url}: "
                                f"{exc or type(exc).__name__}", "provider_unavailable") from None
        except httpx.RemoteProtocolError as exc:
            raise ProviderError(f"{config.name}: the server broke the connection mid-answer: "
                                f"{exc}", "provider_unavailable") from None
        except httpx.HTTPError as exc:
            raise ProviderError(f"{config.name}: {type(exc).__name__}: {exc}",
                                "provider_unavailable") from None
        attempt += 1
        log.warning("provider asked us to retry later",
                    extra={"provider": config.name, "wait_s": wait, "attempt": attempt})
        await asyncio.sleep(wait)


def _bound_text(response: httpx.Response, config: ProviderConfig) -> list[int]:
    """Make `response`'s text, as the event stream reads it (httpx-sse reads aiter_text),
    fail with a ProviderError once more than MAX_EVENT_CHARS arrive without an event: a server
    that sends one endless line would otherwise fill the daemon's memory until a timeout.
    Returns the count, which the reader sets back to 0 at each event."""
    count = [0]
    read = response.aiter_text

    async def aiter_text(chunk_size: int | None = None) -> AsyncIterator[str]:
        async for text in read(chunk_size):
            count[0] += len(text)
            if count[0] > MAX_EVENT_CHARS:
                raise ProviderError(f"{config.name}: the server sent more than "
                                    f"{MAX_EVENT_CHARS:,} characters without a whole event",
                                    "provider_error")
            yield text

    response.aiter_text = aiter_text  # type: ignore[method-assign]
    return count


async def _read_bounded(response: httpx.Response) -> bytes:
    body = b""
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) >= ERROR_BODY_BYTES:
            break
    return body[:ERROR_BODY_BYTES]


def _host(url: str) -> str:
    return httpx.URL(url).netloc.decode("ascii", errors="replace")


def _timeout_message(config: ProviderConfig, url: str, exc: httpx.TimeoutException) -> str:
    what = {httpx.ConnectTimeout: "could not connect to",
            httpx.ReadTimeout: "no data from",
            httpx.WriteTimeout: "could not send the request to",
            httpx.PoolTimeout: "no free connection to"}.get(type(exc), "no answer from")
    return (f"{config.name}: timed out: {what} {_host(url)} within {config.timeout_s:g} s "
            f"(providers.{config.name}.timeout_s)")
