"""One typed call per endpoint of API v1, over httpx: safe retries only (GETs, stops, and runs
with an Idempotency-Key), the daemon's clock from its Date headers, a pinned certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import ssl
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast

import httpx
import truststore
from httpx_sse import EventSource

from agenttui import __version__
from agenttui.client.errors import (
    ApiError,
    BadCursor,
    CertificateMismatch,
    Unavailable,
    describe,
    error_from_response,
    transport_error,
)
from agenttui.client.streams import Backoff, ConversationStream, RunStream, quote_id
from agenttui.models import (
    Conversation,
    ConversationState,
    CreatedRun,
    Me,
    MessagePage,
    Models,
    Run,
    SearchHit,
    StopResult,
)
from agenttui.pinning import pinned_context

_T = TypeVar("_T")

DEFAULT_URL = "http://127.0.0.1:8740"
# How long an idle connection is kept for the next call. httpx's own 5 s meant that a turn
# posted after a pause longer than that (most of them: people read the answer, then type)
# paid a new TCP connection, and over https a new handshake, in front of its first token. Kept
# under the daemon's default idle timeout (idle_timeout_s, 60 s), so the daemon seldom closes
# one first; when it does (a shorter setting), httpx sees the closed socket before reusing it.
KEEPALIVE_S = 50.0
UNSET: Any = object()  # "not given", where None is a value (a conversation's model)


def new_idempotency_key() -> str:
    """A fresh Idempotency-Key for one new run. A caller that may post the same run again (after
    a lost answer) keeps the key and passes it back, so the daemon replays instead of adding."""
    return f"agenttui-{uuid.uuid4()}"


def url_problem(url: str) -> str | None:
    """Why `url` cannot address a daemon (None: it can), checked before any connection."""
    example = "e.g. https://desk.lan:8740"
    try:
        parts = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        return f"{url!r} is not a daemon URL ({exc}; {example})"
    if parts.scheme not in ("http", "https") or not parts.host:
        return f"{url!r} is not a daemon URL ({example})"
    if parts.port is not None and not 0 < parts.port < 65536:
        return f"{url!r} has no valid port (1-65535; {example})"
    return None


def system_trust() -> ssl.SSLContext:
    """Certificates checked against the operating system's trust store and the host name, as
    `--fingerprint ca` promises (truststore: httpx alone uses certifi's bundle, which knows
    nothing of a company's or a home lab's CA installed on this machine)."""
    return truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def canonical_url(url: str) -> str:
    """`url` with its scheme in lower case and no trailing slash: a scheme is case-blind, and
    whether a URL is https:// decides whether its certificate is pinned."""
    scheme, sep, rest = url.partition("://")
    return (scheme.lower() + sep + rest if sep else url).rstrip("/")


def token_problem(token: str) -> str | None:
    """Why `token` cannot be sent as a bearer token (None: it can)."""
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        return "a device token is printable ASCII without spaces (as `agentd token create` " \
               "prints it)"
    return None


class AgentClient:
    """Typed calls to one agentd. Safe retries only: GETs, stops, and runs (Idempotency-Key)."""

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, *,
                 timeout: float = 15.0, stream_timeout: float = 45.0,
                 backoff: Backoff | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 trust_env: bool = True, fingerprint: str | None = None) -> None:
        self.url = canonical_url(url)
        self.stream_timeout = stream_timeout
        self.backoff = backoff or Backoff()
        # An https:// server with a pin is trusted by that pin alone, on every connection.
        self.pinned = fingerprint if fingerprint and self.url.startswith("https://") else None
        headers = {"User-Agent": f"agenttui/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.AsyncClient(
            # The environment's proxies only for https://: through a proxy, a plain http:// URL
            # (the local daemon's default) would hand the proxy the bearer token in clear, and
            # httpx's NO_PROXY=localhost does not cover 127.0.0.1.
            base_url=self.url, headers=headers, transport=transport,
            trust_env=trust_env and self.url.startswith("https://"),
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            # httpx's own caps on connections, with a longer keep-alive.
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=20,
                                keepalive_expiry=KEEPALIVE_S),
            verify=pinned_context(self.pinned) if self.pinned else system_trust(),
            follow_redirects=False)
        self._clock_offset = timedelta(0)

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def encrypted(self) -> bool:
        return self.url.startswith("https://")

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- time ---------------------------------------------------------------------------

    def server_now(self) -> datetime:
        """The daemon's clock as best known (its Date headers), for lease countdowns."""
        return datetime.now(UTC) + self._clock_offset

    def _note_date(self, response: httpx.Response) -> None:
        date = response.headers.get("date")
        if not date:
            return
        with contextlib.suppress(TypeError, ValueError):
            offset = email.utils.parsedate_to_datetime(date) - datetime.now(UTC)
            # Date has one-second resolution: only a real skew is worth correcting.
            self._clock_offset = offset if abs(offset.total_seconds()) > 2 else timedelta(0)

    # -- plumbing -----------------------------------------------------------------------

    async def _send(self, method: str, path: str, *, retries: int = 0,
                    **kwargs: Any) -> httpx.Response:
        attempt = 0
        while True:
            asked = 0.0
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                error = transport_error(self.url, exc, f"cannot reach {self.url}: "
                                                        f"{describe(exc)}")
                if attempt >= retries or isinstance(error, CertificateMismatch):
                    raise error from exc
            else:
                self._note_date(response)
                if 300 <= response.status_code < 400:
                    # Never followed: a redirect must not lead a pinned client anywhere else.
                    raise ApiError(response.status_code, "unexpected_redirect",
                                   f"{self.url} answered with a redirect (not followed)")
                if response.status_code < 400:
                    return response
                error = error_from_response(response)
                if not isinstance(error, Unavailable) or attempt >= retries:
                    raise error
                # A daemon that is starting or draining says when to come back (Retry-After).
                asked = self.backoff.asked(error)
            attempt += 1
            await asyncio.sleep(max(self.backoff.delay(attempt), asked))

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._decoded(await self._send(method, path, **kwargs), lambda data: data)

    async def _shaped(self, build: Callable[[Any], _T], method: str, path: str,
                      **kwargs: Any) -> _T:
        return self._decoded(await self._send(method, path, **kwargs), build)

    def _decoded(self, response: httpx.Response, build: Callable[[Any], _T]) -> _T:
        """`build` of the answer's JSON; an answer that is not the daemon's (no JSON, or not
        the shape asked for: a proxy's page, an auth wall) is an ApiError with status 0, which
        a send counts as uncertain (outcome_unknown) rather than an error it cannot handle."""
        try:
            return build(response.json())
        except (ValueError, KeyError, TypeError, AttributeError, httpx.DecodingError) as exc:
            raise ApiError(0, "bad_answer", f"{self.url} answered {response.status_code} with "
                                            f"something that is not agentd's answer "
                                            f"({type(exc).__name__})") from None

    async def _object(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """An answer that is a JSON object (every endpoint's but a few lists)."""
        return cast("dict[str, Any]", await self._json(method, path, **kwargs))

    @contextlib.asynccontextmanager
    async def open_sse(self, path: str, *, last_event_id: str | None = None,
                       params: Mapping[str, Any] | None = None) -> AsyncIterator[EventSource]:
        """One SSE connection (no reconnect): raises ApiError for an error answer."""
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        timeout = httpx.Timeout(self.stream_timeout, connect=min(self.stream_timeout, 5.0))
        try:
            async with self._http.stream("GET", path, headers=headers, params=params,
                                         timeout=timeout) as response:
                self._note_date(response)
                if response.status_code >= 400:
                    await response.aread()
                    error = error_from_response(response)
                    if error.code == "invalid_cursor" or (last_event_id and
                                                          response.status_code == 431):
                        # A cursor refused, or too long for a header (it names every turn
                        # still open: a conversation with a long queue): start over without it.
                        raise BadCursor(error.message)
                    raise error
                yield EventSource(response)
        except httpx.TransportError as exc:
            raise transport_error(self.url, exc, describe(exc)) from exc

    # -- account and conversations --------------------------------------------------------

    async def me(self) -> Me:
        return await self._shaped(Me.from_wire, "GET", "/v1/me", retries=2)

    async def create_conversation(self, title: str = "",
                                  model: str | None = None) -> Conversation:
        body: dict[str, Any] = {"title": title}
        if model:
            body["model"] = model
        response = await self._send("POST", "/v1/conversations", json=body)
        return self._decoded(response, Conversation.from_wire)

    async def list_conversations(self, limit: int = 100, *,
                                 archived: bool = False) -> list[Conversation]:
        """Most recent first; `archived=True` lists only the archived ones."""
        return (await self.conversation_page(limit, archived=archived))[0]

    async def conversation_page(self, limit: int = 100, *, archived: bool = False,
                                after: str | None = None,
                                ) -> tuple[list[Conversation], str | None]:
        """A page of the list and the `after` of the next one (None: this was the last)."""
        params = {"limit": limit, "archived": "true" if archived else "false",
                  **({"after": after} if after else {})}
        data = await self._json("GET", "/v1/conversations", params=params, retries=2)
        return [Conversation.from_wire(c) for c in data["conversations"]], data.get("next")

    async def get_conversation(self, conversation_id: str, *,
                               limit: int | None = None) -> ConversationState:
        """The state; with `limit`, only the newest page of its transcript."""
        params = {"limit": limit} if limit is not None else None
        return ConversationState.from_wire(
            await self._json("GET", f"/v1/conversations/{quote_id(conversation_id)}",
                             params=params, retries=2))

    async def list_messages(self, conversation_id: str, *, before: str | None = None,
                            limit: int = 100, until: str | None = None) -> MessagePage:
        """A page of the transcript: the newest one, or the one older than `before`; with
        `until`, reaching back to that message."""
        params: dict[str, Any] = {"limit": limit}
        if before is not None:
            params["before"] = before
        if until is not None:
            params["until"] = until
        return await self._shaped(
            MessagePage.from_wire, "GET",
            f"/v1/conversations/{quote_id(conversation_id)}/messages", params=params, retries=2)

    async def rename_conversation(self, conversation_id: str, title: str) -> Conversation:
        return await self.update_conversation(conversation_id, title=title)

    async def update_conversation(self, conversation_id: str, *, title: str | None = None,
                                  model: str | None = UNSET,
                                  archived: bool | None = None) -> Conversation:
        """Change what is given: title, model (None: back to the daemon's default), archived."""
        body: dict[str, Any] = {}
        if title is not None:
            body["title"] = title
        if model is not UNSET:
            body["model"] = model
        if archived is not None:
            body["archived"] = archived
        return await self._shaped(
            Conversation.from_wire, "PATCH", f"/v1/conversations/{quote_id(conversation_id)}",
            json=body, retries=2)

    async def delete_conversation(self, conversation_id: str) -> None:
        """Stop its running turn and remove it with everything in it (404 when already gone)."""
        await self._send("DELETE", f"/v1/conversations/{quote_id(conversation_id)}")

    async def fork_conversation(self, conversation_id: str, message_id: str) -> Conversation:
        """A new conversation holding the transcript up to and including `message_id`."""
        return await self._shaped(
            Conversation.from_wire, "POST",
            f"/v1/conversations/{quote_id(conversation_id)}/fork", json={"message_id": message_id})

    async def list_models(self) -> Models:
        return await self._shaped(Models.from_wire, "GET", "/v1/models", retries=2)

    async def export_conversation(self, conversation_id: str) -> str:
        """The transcript as Markdown."""
        response = await self._send("GET", f"/v1/conversations/{quote_id(conversation_id)}/export",
                                    retries=2)
        return response.text

    async def search(self, query: str, limit: int = 50) -> list[SearchHit]:
        data = await self._json("GET", "/v1/search", params={"q": query, "limit": limit},
                                retries=2)
        return [SearchHit.from_wire(r) for r in data["results"]]

    # -- runs -------------------------------------------------------------------------------

    async def create_run(self, conversation_id: str, content: str, *, model: str | None = None,
                         params: Mapping[str, Any] | None = None, on_busy: str = "enqueue",
                         idempotency_key: str | None = None) -> CreatedRun:
        """Queue a turn (202). Retried on network errors under one Idempotency-Key: never twice."""
        body: dict[str, Any] = {"content": content, "on_busy": on_busy}
        if model:
            body["model"] = model
        if params:
            body["params"] = dict(params)
        return await self._post_run(conversation_id, body, idempotency_key)

    async def retry(self, conversation_id: str, message_id: str = "last", *,
                    content: str | None = None, model: str | None = None,
                    params: Mapping[str, Any] | None = None,
                    idempotency_key: str | None = None) -> CreatedRun:
        """Re-run the latest turn (its question's id, or "last"), edited to `content` if given.

        The old exchange stays in the transcript, marked superseded. Retried on network errors
        under one Idempotency-Key, like any new run.
        """
        body: dict[str, Any] = {"retry_of": message_id}
        if content is not None:
            body["content"] = content
        if model:
            body["model"] = model
        if params is not None:
            body["params"] = dict(params)
        return await self._post_run(conversation_id, body, idempotency_key)

    async def _post_run(self, conversation_id: str, body: dict[str, Any],
                        idempotency_key: str | None) -> CreatedRun:
        """POST a run under one Idempotency-Key, retried on network errors: never twice."""
        key = idempotency_key or new_idempotency_key()
        response = await self._send("POST", f"/v1/conversations/{quote_id(conversation_id)}/runs",
                                    json=body, headers={"Idempotency-Key": key}, retries=3)
        replayed = bool(response.headers.get("Idempotent-Replayed"))
        return self._decoded(response, lambda data: CreatedRun.from_wire(data, replayed=replayed))

    async def get_run(self, run_id: str) -> Run:
        return await self._shaped(Run.from_wire, "GET", f"/v1/runs/{quote_id(run_id)}",
                                  retries=2)

    async def wait_run(self, run_id: str, wait_s: float = 30.0) -> Run:
        """Block (server side) until the run is terminal or `wait_s` seconds passed."""
        return await self._shaped(
            Run.from_wire, "GET", f"/v1/runs/{quote_id(run_id)}/wait",
            params={"timeout": wait_s}, timeout=httpx.Timeout(wait_s + 15.0, connect=5.0),
            retries=2)

    async def cancel_run(self, run_id: str, *, queued_only: bool = False) -> StopResult:
        """Cancel one run: a queued one ends at once (its text comes back as a draft), a
        running one is asked to stop, unless `queued_only`."""
        path = f"/v1/runs/{quote_id(run_id)}/cancel" + ("?only=queued" if queued_only else "")
        return await self._shaped(StopResult.from_wire, "POST", path, retries=3)

    async def stop_conversation(self, conversation_id: str) -> StopResult:
        """The atomic sweep: queued turns cancelled (drafts handed back), the running flagged."""
        return await self._shaped(
            StopResult.from_wire, "POST",
            f"/v1/conversations/{quote_id(conversation_id)}/stop", retries=3)

    async def decide_approval(self, run_id: str, call_id: str, decision: str,
                              note: str | None = None) -> dict[str, Any]:
        """Approve or deny a tool call waiting for approval; the first decision of any device
        wins, a later one raises Conflict whose details name who decided."""
        body: dict[str, Any] = {"decision": decision}
        if note:
            body["note"] = note
        return await self._object(
            "POST", f"/v1/runs/{quote_id(run_id)}/approvals/{quote_id(call_id)}", json=body)

    def run_events(self, run_id: str, *, after: int = 0) -> RunStream:
        return RunStream(self, run_id, after=after)

    def conversation_events(self, conversation_id: str, *, cursor: str | None = None,
                            page: int | None = None) -> ConversationStream:
        """The feed; with `page`, its snapshots carry only the newest `page` messages."""
        return ConversationStream(self, conversation_id, cursor=cursor, page=page)

    # -- devices and pairing ------------------------------------------------------------------

    async def create_pairing(self, device: str | None = None) -> dict[str, Any]:
        """A one-time code for another device of this account: {code, expires_at, command…}."""
        body = {"device": device} if device else {}
        return await self._object("POST", "/v1/pairings", json=body)

    async def pair(self, code: str, device: str) -> dict[str, Any]:
        """Redeem a pairing code (no token needed): {token, account, device, device_id}.

        Never retried: a code is spent by the first request that reaches the server.
        """
        return await self._object("POST", "/v1/pair", json={"code": code, "device": device})

    async def list_devices(self) -> list[dict[str, Any]]:
        devices: list[dict[str, Any]] = (await self._object("GET", "/v1/devices",
                                                            retries=2))["devices"]
        return devices

    async def revoke_device(self, device_id: str) -> None:
        await self._send("DELETE", f"/v1/devices/{quote_id(device_id)}", retries=2)

    # -- service ----------------------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        return await self._object("GET", "/healthz")

    async def openapi(self) -> dict[str, Any]:
        return await self._object("GET", "/openapi.json", retries=2)
