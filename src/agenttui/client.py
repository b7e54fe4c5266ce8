"""The HTTP client of API v1: one typed call per endpoint, and streams that survive disconnects.

`ConversationStream` and `RunStream` reconnect by themselves with backoff and resume from the
last event id, so a consumer sees every journal event exactly once, in order, whatever the
network does: duplicates are dropped by (run, seq), a gap is filled from the run's own journal.
No Textual here: scripts and the `ask` command use this module alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import random
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any
from urllib.parse import quote

import httpx
from httpx_sse import EventSource, ServerSentEvent, SSEError

from agentd.vocabulary import STREAM_ERROR_EVENT, EventType
from agenttui import __version__
from agenttui.models import (
    Attached,
    Conversation,
    ConversationState,
    CreatedRun,
    Lease,
    Me,
    MessagePage,
    Models,
    Run,
    RunEvent,
    SearchHit,
    StopResult,
    parse_time,
)
from agenttui.pinning import certificate_changed, pinned_context

DEFAULT_URL = "http://127.0.0.1:8740"
RETRYABLE_STATUS = frozenset({502, 503, 504})
UNSET: Any = object()  # "not given", where None is a value (a conversation's model)


# -- errors --------------------------------------------------------------------------------


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


def _transport_error(url: str, exc: Exception, what: str) -> ApiError:
    changed = certificate_changed(exc)
    if changed is not None:
        return CertificateMismatch(url, changed.pinned, changed.presented)
    return Unavailable(0, "unreachable", what)


def _error_from(response: httpx.Response) -> ApiError:
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
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


# -- reconnect policy and stream items ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter; attempt 1 waits about `initial` seconds."""

    initial: float = 0.25
    factor: float = 2.0
    maximum: float = 5.0
    jitter: float = 0.2

    def delay(self, attempt: int) -> float:
        base = min(self.maximum, self.initial * self.factor ** max(0, attempt - 1))
        return base * (1 + random.uniform(-self.jitter, self.jitter))


class ConnectionState(StrEnum):
    CONNECTING = "connecting"
    LIVE = "live"
    RECONNECTING = "reconnecting"
    RESUMED = "resumed"  # live again, continuing from the cursor it had
    CLOSED = "closed"  # gave up: the server refused (401, 404, ...)


@dataclass(frozen=True, slots=True)
class ConnectionStatus:
    state: ConnectionState
    attempt: int = 0
    error: str | None = None
    retry_in: float | None = None
    resumed_seq: int | None = None  # resumed: the seq of the last event seen before the cut

    @property
    def connected(self) -> bool:
        return self.state in (ConnectionState.LIVE, ConnectionState.RESUMED)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The server's whole state of the conversation; opens every (re)connection.

    `resumed` is False on a fresh start (no cursor, or the server refused it): then the feed
    replays the active runs from their first event, and a consumer rebuilds from this snapshot.
    """

    state: ConversationState
    resumed: bool


@dataclass(frozen=True, slots=True)
class LeaseChanged:
    lease: Lease | None


@dataclass(frozen=True, slots=True)
class PresenceChanged:
    attached: tuple[Attached, ...]


@dataclass(frozen=True, slots=True)
class RunStateChanged:
    """A run's row changed ahead of its journal (a stop was requested)."""

    run_id: str
    status: str
    cancel_requested: bool


@dataclass(frozen=True, slots=True)
class ConversationChanged:
    """The conversation itself changed: its title, model or archive mark, the messages a retry
    or an edit superseded (message id -> the new question's id), its token totals."""

    title: str
    model: str | None
    archived_at: datetime | None
    superseded: dict[str, str]
    usage: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ConversationDeleted:
    """The conversation was deleted (on any device): the feed's last item."""

    conversation_id: str


FeedItem = (Snapshot | RunEvent | LeaseChanged | PresenceChanged | RunStateChanged
            | ConversationChanged | ConversationDeleted | ConnectionStatus)


class _BadCursor(Exception):
    pass


class _ProtocolError(Exception):
    pass


def _stream_error(sse: ServerSentEvent) -> ApiError:
    """The server ended the stream on purpose (e.g. this device was revoked): never resumed."""
    try:
        error = json.loads(sse.data)["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "stream_error", "the server ended the stream"
    kind = Unauthorized if code == "device_revoked" else ApiError
    return kind(401 if code == "device_revoked" else 400, code, message)


# -- the client -----------------------------------------------------------------------------


class AgentClient:
    """Typed calls to one agentd. Safe retries only: GETs, stops, and runs (Idempotency-Key)."""

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, *,
                 timeout: float = 15.0, stream_timeout: float = 45.0,
                 backoff: Backoff | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 trust_env: bool = True, fingerprint: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.stream_timeout = stream_timeout
        self.backoff = backoff or Backoff()
        # An https:// server with a pin is trusted by that pin alone, on every connection.
        self.pinned = fingerprint if fingerprint and self.url.startswith("https://") else None
        headers = {"User-Agent": f"agenttui/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=headers, transport=transport, trust_env=trust_env,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            verify=pinned_context(self.pinned) if self.pinned else True,
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
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                error = _transport_error(self.url, exc, f"cannot reach {self.url}: "
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
                error = _error_from(response)
                if not isinstance(error, Unavailable) or attempt >= retries:
                    raise error
            attempt += 1
            await asyncio.sleep(self.backoff.delay(attempt))

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return (await self._send(method, path, **kwargs)).json()

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
                    error = _error_from(response)
                    if error.code == "invalid_cursor":
                        raise _BadCursor(error.message)
                    raise error
                yield EventSource(response)
        except httpx.TransportError as exc:
            raise _transport_error(self.url, exc, describe(exc)) from exc

    # -- account and conversations --------------------------------------------------------

    async def me(self) -> Me:
        return Me.from_wire(await self._json("GET", "/v1/me", retries=2))

    async def create_conversation(self, title: str = "",
                                  model: str | None = None) -> Conversation:
        body: dict[str, Any] = {"title": title}
        if model:
            body["model"] = model
        return Conversation.from_wire(await self._json("POST", "/v1/conversations", json=body))

    async def list_conversations(self, limit: int = 100, *,
                                 archived: bool = False) -> list[Conversation]:
        """Most recent first; `archived=True` lists only the archived ones."""
        params = {"limit": limit, "archived": "true" if archived else "false"}
        data = await self._json("GET", "/v1/conversations", params=params, retries=2)
        return [Conversation.from_wire(c) for c in data["conversations"]]

    async def get_conversation(self, conversation_id: str, *,
                               limit: int | None = None) -> ConversationState:
        """The state; with `limit`, only the newest page of its transcript."""
        params = {"limit": limit} if limit is not None else None
        return ConversationState.from_wire(
            await self._json("GET", f"/v1/conversations/{_id(conversation_id)}", params=params,
                             retries=2))

    async def list_messages(self, conversation_id: str, *, before: str | None = None,
                            limit: int = 100, until: str | None = None) -> MessagePage:
        """A page of the transcript: the newest one, or the one older than `before`; with
        `until`, reaching back to that message."""
        params: dict[str, Any] = {"limit": limit}
        if before is not None:
            params["before"] = before
        if until is not None:
            params["until"] = until
        return MessagePage.from_wire(await self._json(
            "GET", f"/v1/conversations/{_id(conversation_id)}/messages", params=params,
            retries=2))

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
        return Conversation.from_wire(await self._json(
            "PATCH", f"/v1/conversations/{_id(conversation_id)}", json=body, retries=2))

    async def delete_conversation(self, conversation_id: str) -> None:
        """Stop its running turn and remove it with everything in it (404 when already gone)."""
        await self._send("DELETE", f"/v1/conversations/{_id(conversation_id)}")

    async def fork_conversation(self, conversation_id: str, message_id: str) -> Conversation:
        """A new conversation holding the transcript up to and including `message_id`."""
        return Conversation.from_wire(await self._json(
            "POST", f"/v1/conversations/{_id(conversation_id)}/fork",
            json={"message_id": message_id}))

    async def list_models(self) -> Models:
        return Models.from_wire(await self._json("GET", "/v1/models", retries=2))

    async def export_conversation(self, conversation_id: str) -> str:
        """The transcript as Markdown."""
        response = await self._send("GET", f"/v1/conversations/{_id(conversation_id)}/export",
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
        key = idempotency_key or f"agenttui-{uuid.uuid4()}"
        response = await self._send("POST", f"/v1/conversations/{_id(conversation_id)}/runs",
                                    json=body, headers={"Idempotency-Key": key}, retries=3)
        return CreatedRun.from_wire(response.json(), replayed=bool(
            response.headers.get("Idempotent-Replayed")))

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
        key = idempotency_key or f"agenttui-{uuid.uuid4()}"
        response = await self._send("POST", f"/v1/conversations/{_id(conversation_id)}/runs",
                                    json=body, headers={"Idempotency-Key": key}, retries=3)
        return CreatedRun.from_wire(response.json(), replayed=bool(
            response.headers.get("Idempotent-Replayed")))

    async def get_run(self, run_id: str) -> Run:
        return Run.from_wire(await self._json("GET", f"/v1/runs/{_id(run_id)}", retries=2))

    async def wait_run(self, run_id: str, wait_s: float = 30.0) -> Run:
        """Block (server side) until the run is terminal or `wait_s` seconds passed."""
        return Run.from_wire(await self._json(
            "GET", f"/v1/runs/{_id(run_id)}/wait", params={"timeout": wait_s},
            timeout=httpx.Timeout(wait_s + 15.0, connect=5.0), retries=2))

    async def cancel_run(self, run_id: str) -> StopResult:
        """Cancel one run: a queued one ends at once (its text comes back as a draft), a
        running one is asked to stop."""
        return StopResult.from_wire(await self._json("POST", f"/v1/runs/{_id(run_id)}/cancel",
                                                     retries=3))

    async def stop_conversation(self, conversation_id: str) -> StopResult:
        """The atomic sweep: queued turns cancelled (drafts handed back), the running flagged."""
        return StopResult.from_wire(await self._json(
            "POST", f"/v1/conversations/{_id(conversation_id)}/stop", retries=3))

    async def decide_approval(self, run_id: str, call_id: str, decision: str,
                              note: str | None = None) -> dict[str, Any]:
        """Approve or deny a tool call waiting for approval; the first decision of any device
        wins, a later one raises Conflict whose details name who decided."""
        body: dict[str, Any] = {"decision": decision}
        if note:
            body["note"] = note
        return await self._json("POST", f"/v1/runs/{_id(run_id)}/approvals/{_id(call_id)}",
                                json=body)

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
        return await self._json("POST", "/v1/pairings", json=body)

    async def pair(self, code: str, device: str) -> dict[str, Any]:
        """Redeem a pairing code (no token needed): {token, account, device, device_id}.

        Never retried: a code is spent by the first request that reaches the server.
        """
        return await self._json("POST", "/v1/pair", json={"code": code, "device": device})

    async def list_devices(self) -> list[dict[str, Any]]:
        return (await self._json("GET", "/v1/devices", retries=2))["devices"]

    async def revoke_device(self, device_id: str) -> None:
        await self._send("DELETE", f"/v1/devices/{_id(device_id)}", retries=2)

    # -- service ----------------------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        return await self._json("GET", "/healthz")

    async def openapi(self) -> dict[str, Any]:
        return await self._json("GET", "/openapi.json", retries=2)


def _id(value: str) -> str:
    return quote(str(value), safe="")


# -- resumable streams ------------------------------------------------------------------------


class _ResumableStream:
    """The reconnect loop shared by both feeds; subclasses interpret the frames."""

    def __init__(self, client: AgentClient, path: str,
                 params: Mapping[str, Any] | None = None) -> None:
        self._client = client
        self._path = path
        self._params = params
        self._done = False
        self.status = ConnectionStatus(ConnectionState.CONNECTING)
        self.reconnects = 0
        self.duplicates_dropped = 0
        self.gaps_filled = 0

    def _resume_id(self) -> str | None:
        raise NotImplementedError

    def _forget_cursor(self) -> None:
        raise NotImplementedError

    def _opened(self, resumed: bool) -> ConnectionStatus | None:
        """The status to report once a connection is accepted (None: wait for a frame)."""
        return None

    def _handle(self, sse: ServerSentEvent, resumed: bool) -> AsyncIterator[FeedItem]:
        raise NotImplementedError

    def _status(self, status: ConnectionStatus) -> ConnectionStatus:
        self.status = status
        return status

    async def __aiter__(self) -> AsyncIterator[FeedItem]:
        attempt = 0
        error: str | None = None
        yield self._status(ConnectionStatus(ConnectionState.CONNECTING))
        while not self._done:
            if attempt:
                delay = self._client.backoff.delay(attempt)
                yield self._status(ConnectionStatus(ConnectionState.RECONNECTING, attempt,
                                                    error, delay))
                await asyncio.sleep(delay)
            sent = self._resume_id()
            try:
                async with self._client.open_sse(self._path, last_event_id=sent,
                                                 params=self._params) as source:
                    if attempt:
                        self.reconnects += 1
                    opened = self._opened(sent is not None)
                    if opened is not None:
                        attempt = 0
                        yield self._status(opened)
                    async for sse in source.aiter_sse():
                        async for item in self._handle(sse, sent is not None):
                            if isinstance(item, ConnectionStatus) and item.connected:
                                attempt = 0
                            yield item
                        if self._done:
                            return
                error = "the server closed the stream"
            except _BadCursor:
                self._forget_cursor()  # start over from a fresh snapshot, at once
                continue
            except ApiError as exc:
                if isinstance(exc, Unavailable) or exc.status >= 500:
                    error = describe(exc)
                    attempt += 1
                    continue
                yield self._status(ConnectionStatus(ConnectionState.CLOSED, attempt,
                                                    describe(exc)))
                raise
            except (httpx.TransportError, SSEError, _ProtocolError) as exc:
                error = describe(exc)
            except (KeyError, TypeError, ValueError) as exc:  # a frame this client cannot read
                error = f"unexpected data from the server: {describe(exc)}"
            attempt += 1


class ConversationStream(_ResumableStream):
    """The conversation feed (snapshot, every run's events, lease, presence), exactly once.

    Yields `ConnectionStatus` whenever the connection changes, a `Snapshot` at the start of
    every connection, then `RunEvent`, `LeaseChanged` and `PresenceChanged` items.
    """

    def __init__(self, client: AgentClient, conversation_id: str, *,
                 cursor: str | None = None, page: int | None = None) -> None:
        super().__init__(client, f"/v1/conversations/{_id(conversation_id)}/events",
                         {"limit": page} if page is not None else None)
        self.conversation_id = conversation_id
        self.cursor = cursor
        self._seqs: dict[str, int] = {}
        self.last_seq: int | None = None

    def _resume_id(self) -> str | None:
        return self.cursor

    def _forget_cursor(self) -> None:
        self.cursor = None

    def close(self) -> None:
        """End iteration after the current item (cancelling the consumer works too)."""
        self._done = True

    async def _handle(self, sse: ServerSentEvent, resumed: bool) -> AsyncIterator[FeedItem]:
        if not sse.data:
            return  # an event with no data is no event (SSE spec); keepalives look like this
        if sse.event == STREAM_ERROR_EVENT:
            raise _stream_error(sse)
        try:
            data = json.loads(sse.data)
        except ValueError as exc:
            raise _ProtocolError(f"a {sse.event!r} frame without JSON") from exc
        if sse.event == "snapshot":
            if not resumed:
                self._seqs.clear()  # the server replays active runs from their start
            self.cursor = sse.id or self.cursor
            yield Snapshot(ConversationState.from_wire(data["conversation"]), resumed)
            state = ConnectionState.RESUMED if resumed else ConnectionState.LIVE
            yield self._status(ConnectionStatus(
                state, resumed_seq=self.last_seq if resumed else None))
            return
        if sse.event == "lease":
            self.cursor = sse.id or self.cursor
            yield LeaseChanged(Lease.from_wire(data.get("lease")))
            return
        if sse.event == "run_state":
            self.cursor = sse.id or self.cursor
            yield RunStateChanged(str(data["run_id"]), str(data.get("status")),
                                  bool(data.get("cancel_requested")))
            return
        if sse.event == "presence":
            self.cursor = sse.id or self.cursor
            yield PresenceChanged(tuple(Attached.from_wire(a) for a in data.get("attached")
                                        or ()))
            return
        if sse.event == "conversation":
            self.cursor = sse.id or self.cursor
            about = data.get("conversation") or {}
            yield ConversationChanged(
                str(about.get("title") or ""), about.get("model"),
                parse_time(about.get("archived_at")),
                {str(k): str(v) for k, v in (data.get("superseded") or {}).items()},
                dict(data.get("usage") or {}))
            return
        if sse.event == "deleted":
            self._done = True  # nothing follows: the conversation is gone
            yield ConversationDeleted(str(data.get("conversation_id") or self.conversation_id))
            return
        if "seq" not in data or "run_id" not in data:
            self.cursor = sse.id or self.cursor  # a frame type this client does not know
            return
        event = RunEvent.from_wire(data)
        last = self._seqs.get(event.run_id, 0)
        if event.seq <= last:
            self.duplicates_dropped += 1
            self.cursor = sse.id or self.cursor
            return
        if event.seq > last + 1:
            # Never skip: read the missing part from the run's own journal first. A failure
            # here reconnects from the cursor before this frame, so nothing is lost either way.
            for missing in await self._backfill(event.run_id, last, event.seq - 1):
                self._seqs[missing.run_id] = missing.seq
                self.gaps_filled += 1
                yield missing
        self._seqs[event.run_id] = event.seq
        self.last_seq = event.seq
        self.cursor = sse.id or self.cursor
        yield event

    async def _backfill(self, run_id: str, after: int, upto: int) -> list[RunEvent]:
        found: list[RunEvent] = []
        async with asyncio.timeout(self._client.stream_timeout), self._client.open_sse(
                f"/v1/runs/{_id(run_id)}/events", params={"from": after}) as source:
            async for sse in source.aiter_sse():
                if not sse.data:
                    continue
                if sse.event == STREAM_ERROR_EVENT:
                    raise _stream_error(sse)
                event = RunEvent.from_wire(json.loads(sse.data), run_id)
                if event.seq > upto:
                    break
                found.append(event)
                if event.seq == upto:
                    break
        if [e.seq for e in found] != list(range(after + 1, upto + 1)):
            raise _ProtocolError(f"run {run_id}: events {after + 1}..{upto} are missing")
        return found


class RunStream(_ResumableStream):
    """One run's journal after `after`, exactly once, ending after its `complete` event."""

    def __init__(self, client: AgentClient, run_id: str, *, after: int = 0) -> None:
        super().__init__(client, f"/v1/runs/{_id(run_id)}/events")
        self.run_id = run_id
        self.last_seq = after

    def _resume_id(self) -> str | None:
        return str(self.last_seq)

    def _forget_cursor(self) -> None:  # seqs are never refused; kept for the interface
        pass

    def _opened(self, resumed: bool) -> ConnectionStatus | None:
        if self.reconnects:
            return ConnectionStatus(ConnectionState.RESUMED, resumed_seq=self.last_seq)
        return ConnectionStatus(ConnectionState.LIVE)

    async def _handle(self, sse: ServerSentEvent, resumed: bool) -> AsyncIterator[FeedItem]:
        if not sse.data:
            return
        if sse.event == STREAM_ERROR_EVENT:
            raise _stream_error(sse)
        try:
            event = RunEvent.from_wire(json.loads(sse.data), self.run_id)
        except (ValueError, KeyError) as exc:
            raise _ProtocolError(f"a {sse.event!r} frame without a valid payload") from exc
        if event.seq <= self.last_seq:
            self.duplicates_dropped += 1
            return
        if event.seq != self.last_seq + 1:
            raise _ProtocolError(f"run {self.run_id}: expected seq {self.last_seq + 1}, "
                                 f"got {event.seq}")  # reconnect from last_seq
        self.last_seq = event.seq
        yield event
        if event.type == EventType.COMPLETE:
            self._done = True
