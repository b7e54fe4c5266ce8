"""Streams that survive disconnects: `ConversationStream` and `RunStream` reconnect by
themselves with backoff and resume from the last event id, so a consumer sees every journal event
exactly once, in order, whatever the network does: duplicates are dropped by (run, seq), a gap is
filled from the run's own journal. Also the items they yield and the reconnect policy: the backoff
starts over only after a connection proved itself (new events, or up for a while), never merely
because the server accepted it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
from httpx_sse import ServerSentEvent, SSEError

from agentd.vocabulary import STREAM_ERROR_EVENT, EventType
from agenttui.client.errors import (
    ApiError,
    BadCursor,
    RateLimited,
    Unauthorized,
    Unavailable,
    describe,
)
from agenttui.models import (
    Attached,
    ConversationState,
    Lease,
    RunEvent,
    parse_time,
)

if TYPE_CHECKING:
    from agenttui.client.http import AgentClient


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter; attempt 1 waits about `initial` seconds.

    A stream starts the backoff over once a connection has stayed up `healthy_after` seconds
    (or delivered new events): one the server accepts and then drops at once counts as failed.
    A server's Retry-After (a 429, or a 503 while it starts or drains) is honoured up to
    `retry_after_cap` seconds.
    """

    initial: float = 0.25
    factor: float = 2.0
    maximum: float = 5.0
    jitter: float = 0.2
    healthy_after: float = 10.0
    retry_after_cap: float = 60.0

    def delay(self, attempt: int) -> float:
        base = min(self.maximum, self.initial * self.factor ** max(0, attempt - 1))
        return base * (1 + random.uniform(-self.jitter, self.jitter))

    def asked(self, error: ApiError) -> float:
        """The wait the server asked for with `error` (Retry-After), capped; 0 if none."""
        return min(error.retry_after or 0.0, self.retry_after_cap)


# The longest cursor sent back as Last-Event-ID: under the 8190 bytes a header may hold in
# aiohttp (and in nginx's default buffers), with room for the rest of the line.
MAX_RESUME_ID = 8000


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


def quote_id(value: str) -> str:
    """An id as one path segment of a URL."""
    return quote(str(value), safe="")


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
        self.new_events = 0  # journal events seen for the first time: proof a connection works

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

    async def __aiter__(self) -> AsyncGenerator[FeedItem, None]:
        backoff = self._client.backoff
        attempt = 0
        error: str | None = None
        wait_at_least = 0.0  # a 429's Retry-After
        yield self._status(ConnectionStatus(ConnectionState.CONNECTING))
        while not self._done:
            if attempt:
                delay = max(backoff.delay(attempt), wait_at_least)
                yield self._status(ConnectionStatus(ConnectionState.RECONNECTING, attempt,
                                                    error, delay))
                await asyncio.sleep(delay)
            wait_at_least = 0.0
            sent = self._resume_id()
            if sent is not None and len(sent) > MAX_RESUME_ID:
                # Too long for a request header (a conversation with some 145 open turns): a
                # daemon answers 431, a proxy in front of it maybe a 400 of its own. Start
                # over from a fresh snapshot rather than send it.
                self._forget_cursor()
                sent = None
            connected_at: float | None = None
            events_before = self.new_events
            try:
                async with self._client.open_sse(self._path, last_event_id=sent,
                                                 params=self._params) as source:
                    connected_at = time.monotonic()
                    if attempt:
                        self.reconnects += 1
                    opened = self._opened(sent is not None)
                    if opened is not None:
                        yield self._status(opened)
                    async for sse in source.aiter_sse():
                        async for item in self._handle(sse, sent is not None):
                            yield item
                        if self._done:
                            return
                error = "the server closed the stream"
            except BadCursor:
                # Start over from a fresh snapshot, at once (whatever failed before), and say
                # so: the place the stream was resumed from is no longer served.
                self._forget_cursor()
                attempt = 0
                yield self._status(ConnectionStatus(
                    ConnectionState.RECONNECTING, attempt,
                    "the stream's place was refused; starting over from the current state", 0.0))
                continue
            except ApiError as exc:
                if not (isinstance(exc, (RateLimited, Unavailable)) or exc.status >= 500):
                    yield self._status(ConnectionStatus(ConnectionState.CLOSED, attempt,
                                                        describe(exc)))
                    raise
                # Over a limit or busy for now: wait at least as long as the server asks.
                error = describe(exc)
                wait_at_least = backoff.asked(exc)
            except TimeoutError:  # a gap's backfill that did not answer in stream_timeout
                error = "the server did not answer in time"
            except (httpx.TransportError, SSEError, _ProtocolError) as exc:
                error = describe(exc)
            except (KeyError, TypeError, ValueError) as exc:  # a frame this client cannot read
                error = f"unexpected data from the server: {describe(exc)}"
            # Accepted is not enough to start the backoff over: a server that takes the
            # connection and drops it straight away would be hammered every `initial` seconds.
            if connected_at is not None and (
                    self.new_events > events_before or
                    time.monotonic() - connected_at >= backoff.healthy_after):
                attempt = 0
            attempt += 1


class ConversationStream(_ResumableStream):
    """The conversation feed (snapshot, every run's events, lease, presence), exactly once.

    Yields `ConnectionStatus` whenever the connection changes, a `Snapshot` at the start of
    every connection, then `RunEvent`, `LeaseChanged` and `PresenceChanged` items.
    """

    def __init__(self, client: AgentClient, conversation_id: str, *,
                 cursor: str | None = None, page: int | None = None) -> None:
        super().__init__(client, f"/v1/conversations/{quote_id(conversation_id)}/events",
                         {"limit": page} if page is not None else None)
        self.conversation_id = conversation_id
        self.cursor = cursor
        self._seqs: dict[str, int] = {}
        # The highest seq ever yielded per run: a fresh snapshot replays active runs from their
        # start, and replayed events are not progress.
        self._highest: dict[str, int] = {}
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
                self._note_progress(missing)
                yield missing
        self._seqs[event.run_id] = event.seq
        self.last_seq = event.seq
        self.cursor = sse.id or self.cursor
        self._note_progress(event)
        yield event

    def _note_progress(self, event: RunEvent) -> None:
        if event.seq > self._highest.get(event.run_id, 0):
            self._highest[event.run_id] = event.seq
            self.new_events += 1

    async def _backfill(self, run_id: str, after: int, upto: int) -> list[RunEvent]:
        found: list[RunEvent] = []
        async with asyncio.timeout(self._client.stream_timeout), self._client.open_sse(
                f"/v1/runs/{quote_id(run_id)}/events", params={"from": after}) as source:
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
        super().__init__(client, f"/v1/runs/{quote_id(run_id)}/events")
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
        self.new_events += 1
        yield event
        if event.type == EventType.COMPLETE:
            self._done = True
