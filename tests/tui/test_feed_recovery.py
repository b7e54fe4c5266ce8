"""The client's streams recover from what a live daemon and a bad network can do to them: a 429
or a 503 waits out its Retry-After (the feed and retried calls alike), a gap's backfill that
never answers reconnects instead of ending the feed, and a connection that the server accepts
and drops at once makes the backoff grow."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable

import httpx
import pytest

from agentd.vocabulary import EventType, RunStatus
from agenttui.client import (
    AgentClient,
    ConnectionState,
    ConnectionStatus,
    FeedItem,
    RunEvent,
    Snapshot,
    streams,
)
from tests.support.daemon import Daemon
from tests.support.factories import Device
from tests.tui.helpers import FAST_BACKOFF, client_for, is_stream

WAIT_S = 60.0
TOO_MANY = {"error": {"code": "too_many_streams", "message": "too many open streams"}}
BUSY = {"error": {"code": "unavailable", "message": "the database is unavailable; retry shortly"}}


def frame_data(frame: bytes) -> dict | None:
    """The JSON of an SSE frame's data line, if it has one."""
    for line in frame.decode().splitlines():
        if line.startswith("data:"):
            with contextlib.suppress(ValueError):
                data = json.loads(line[5:].strip())
                return data if isinstance(data, dict) else None
    return None


class _Frames(httpx.AsyncByteStream):
    """A response body passed on frame by frame; `keep(frame)` False drops a frame, `cut_after`
    True ends the connection with a read error right after that frame."""

    def __init__(self, inner: httpx.AsyncByteStream, keep: Callable[[bytes], bool],
                 cut_after: Callable[[bytes], bool]) -> None:
        self.inner = inner
        self.keep = keep
        self.cut_after = cut_after

    async def __aiter__(self) -> AsyncIterator[bytes]:
        buffer = b""
        async for chunk in self.inner:
            buffer += chunk
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                if self.keep(frame):
                    yield frame + b"\n\n"
                if self.cut_after(frame):
                    raise httpx.ReadError("connection cut by the test")

    async def aclose(self) -> None:
        await self.inner.aclose()


class Network(httpx.AsyncBaseTransport):
    """A real transport to the daemon whose event streams a test rewrites: `refuse(request)`
    answers a stream with a response of its own, `hang(request)` never answers it, and each
    stream's frames go through `keep` / `cut_after`."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.refuse: Callable[[httpx.Request], httpx.Response | None] = lambda r: None
        self.hang: Callable[[httpx.Request], bool] = lambda r: False
        self.keep: Callable[[bytes], bool] = lambda f: True
        self.cut_after: Callable[[bytes], bool] = lambda f: False
        self.hung = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not is_stream(request):
            return await self.inner.handle_async_request(request)
        refused = self.refuse(request)
        if refused is not None:
            return refused
        if self.hang(request):
            self.hung += 1
            await asyncio.Event().wait()  # a host that took the request and never answers
        response = await self.inner.handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_Frames(response.stream, self.keep, self.cut_after),
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def take(stream: AsyncIterator[FeedItem], until: Callable[[FeedItem], bool],
               within: float = WAIT_S) -> list[FeedItem]:
    """Items from `stream` up to and including the first for which `until` is true."""
    items: list[FeedItem] = []
    async with asyncio.timeout(within):
        async for item in stream:
            items.append(item)
            if until(item):
                return items
    raise AssertionError(f"the stream ended before the awaited item: {items}")


async def drain(stream: AsyncIterable[FeedItem], until: Callable[[FeedItem], bool]
                ) -> list[FeedItem]:
    """`take` from a stream of its own, closed afterwards."""
    async with contextlib.aclosing(aiter(stream)) as items:
        return await take(items, until)


def nth_reconnect(n: int) -> Callable[[FeedItem], bool]:
    """A `take` condition: the `n`th reconnecting status."""
    seen = 0

    def until(item: FeedItem) -> bool:
        nonlocal seen
        seen += bool(reconnecting([item]))
        return seen == n

    return until


def reconnecting(items: list[FeedItem]) -> list[ConnectionStatus]:
    return [i for i in items if isinstance(i, ConnectionStatus)
            and i.state == ConnectionState.RECONNECTING]


async def test_a_429_on_the_feed_waits_its_retry_after_then_connects(
        daemon: Daemon, desk: Device) -> None:
    network = Network()
    refusals = [httpx.Response(429, headers={"Retry-After": "1"}, json=TOO_MANY)]

    def refuse(request: httpx.Request) -> httpx.Response | None:
        return refusals.pop() if refusals else None

    network.refuse = refuse
    async with client_for(daemon, desk, transport=network) as client:
        conversation = await client.create_conversation("rate limited")
        feed = client.conversation_events(conversation.id)
        async with contextlib.aclosing(feed.__aiter__()) as items:
            seen = await take(items, lambda i: isinstance(i, ConnectionStatus) and i.connected)
    [waited] = reconnecting(seen)
    assert waited.error == "too many open streams"
    # The daemon's Retry-After, not the client's own first backoff step (0.05 s here).
    assert waited.retry_in is not None and waited.retry_in >= 1.0, waited
    assert any(isinstance(i, Snapshot) for i in seen)
    assert feed.status.state == ConnectionState.LIVE


async def test_a_429_retry_after_is_honoured_up_to_a_cap(daemon: Daemon, desk: Device) -> None:
    network = Network()
    network.refuse = lambda r: httpx.Response(429, headers={"Retry-After": "86400"},
                                              json=TOO_MANY)
    async with client_for(daemon, desk, transport=network) as client:
        conversation = await client.create_conversation("rate limited for a day")
        seen = await drain(client.conversation_events(conversation.id),
                           lambda i: bool(reconnecting([i])))
    assert reconnecting(seen)[0].retry_in == FAST_BACKOFF.retry_after_cap == 60.0


async def test_a_503_on_the_feed_waits_its_retry_after(daemon: Daemon, desk: Device) -> None:
    network = Network()
    refusals = [httpx.Response(503, headers={"Retry-After": "1"}, json=BUSY)]
    network.refuse = lambda r: refusals.pop() if refusals else None
    async with client_for(daemon, desk, transport=network) as client:
        conversation = await client.create_conversation("busy")
        seen = await drain(client.conversation_events(conversation.id),
                           lambda i: isinstance(i, ConnectionStatus) and i.connected)
    [waited] = reconnecting(seen)
    assert waited.error == BUSY["error"]["message"]
    # The daemon's Retry-After, not the client's own first backoff step (0.05 s here).
    assert waited.retry_in is not None and waited.retry_in >= 1.0, waited


class _BusyOnce(httpx.AsyncBaseTransport):
    """A real transport to the daemon that answers the first GET of `path` with a 503 asking
    for a wait of `retry_after` seconds, and notes when each request of that path went out."""

    def __init__(self, path: str, retry_after: str) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.path = path
        self.retry_after = retry_after
        self.sent_at: list[float] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == self.path:
            self.sent_at.append(time.monotonic())
            if len(self.sent_at) == 1:
                return httpx.Response(503, headers={"Retry-After": self.retry_after}, json=BUSY)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_retried_call_waits_a_503s_retry_after(daemon: Daemon, desk: Device) -> None:
    network = _BusyOnce("/v1/me", "1")
    async with client_for(daemon, desk, transport=network) as client:
        me = await client.me()
    assert me.device == desk.name
    first, second = network.sent_at
    # Asked again after the daemon's second, not after the client's own 0.05 s first step.
    assert second - first >= 1.0, network.sent_at


@pytest.mark.parametrize("sent", [False, True], ids=["left-unsent", "refused-431"])
async def test_a_cursor_too_long_for_a_header_starts_the_feed_over(
        daemon: Daemon, desk: Device, monkeypatch: pytest.MonkeyPatch, sent: bool) -> None:
    """The feed's cursor names every turn still open: with some 170 queued in one conversation
    it outgrows a request header. The client starts over from a fresh snapshot rather than
    send it; sent anyway (a daemon with a smaller limit), the daemon answers the resume 431,
    and the feed starts over then. It used to end for good (`disconnected`)."""
    if sent:
        monkeypatch.setattr(streams, "MAX_RESUME_ID", 1_000_000)
    network = Network()
    cuts = [True]
    # The connection is cut once, right after its snapshot (whose id is the long cursor).
    network.cut_after = lambda frame: b"event: snapshot" in frame and bool(cuts) and cuts.pop()
    async with client_for(daemon, desk) as api, \
            client_for(daemon, desk, transport=network) as client:
        conversation = await api.create_conversation("a long queue")
        await api.create_run(conversation.id, "a long one",
                             params={"tokens": 2000, "delay_ms": 50})
        for n in range(170):
            await api.create_run(conversation.id, f"follow-up {n}",
                                 params={"tokens": 1, "delay_ms": 0})
        try:
            seen = await drain(client.conversation_events(conversation.id),
                               lambda i: isinstance(i, Snapshot) and not cuts)
        finally:
            await api.stop_conversation(conversation.id)
    [first, again] = [i for i in seen if isinstance(i, Snapshot)]
    assert not again.resumed  # started over, without the cursor
    assert len(again.state.runs) == len(first.state.runs) == 171
    assert ("starting over" in (reconnecting(seen)[-1].error or "")) is sent, reconnecting(seen)


async def test_a_backfill_that_never_answers_reconnects_and_loses_nothing(
        daemon: Daemon, desk: Device) -> None:
    network = Network()
    dropped: list[bytes] = []

    def keep(frame: bytes) -> bool:  # lose the first seq 2 frame: the client sees a gap
        data = frame_data(frame)
        if not dropped and data is not None and data.get("seq") == 2 and "run_id" in data:
            dropped.append(frame)
            return False
        return True

    network.keep = keep
    network.hang = lambda r: "/v1/runs/" in r.url.path and network.hung == 0  # the backfill
    client = AgentClient(daemon.url, desk.token, trust_env=False, transport=network,
                         backoff=FAST_BACKOFF, timeout=30.0, stream_timeout=3.0)
    async with client:
        conversation = await client.create_conversation("gap")
        async with contextlib.aclosing(
                client.conversation_events(conversation.id).__aiter__()) as items:
            await take(items, lambda i: isinstance(i, Snapshot))
            run = await client.create_run(conversation.id, "fill the gap",
                                          params={"tokens": 8, "delay_ms": 20})
            seen = await take(items, lambda i: isinstance(i, RunEvent) and
                              i.run_id == run.run_id and i.type == EventType.COMPLETE)
    assert dropped and network.hung == 1  # the gap was there and its backfill hung
    [waited] = reconnecting(seen)
    assert waited.error == "the server did not answer in time"
    assert any(isinstance(i, ConnectionStatus) and i.state == ConnectionState.RESUMED
               for i in seen)
    events = [i for i in seen if isinstance(i, RunEvent) and i.run_id == run.run_id]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))  # each once, in order
    assert events[-1].payload.get("status") == RunStatus.COMPLETED


async def test_a_feed_dropped_after_every_snapshot_backs_off_further_each_time(
        daemon: Daemon, desk: Device) -> None:
    network = Network()
    network.cut_after = lambda frame: b"event: snapshot" in frame
    async with client_for(daemon, desk, transport=network) as client:
        conversation = await client.create_conversation("flapping")
        seen = await drain(client.conversation_events(conversation.id), nth_reconnect(4))
    assert sum(isinstance(i, Snapshot) for i in seen) == 4  # each connection was accepted
    assert [s.attempt for s in reconnecting(seen)] == [1, 2, 3, 4]


async def test_a_run_stream_accepted_then_dropped_backs_off_but_progress_starts_over(
        daemon: Daemon, desk: Device) -> None:
    async with client_for(daemon, desk) as api:
        conversation = await api.create_conversation("run stream")
        run = await api.create_run(conversation.id, "a few events",
                                   params={"tokens": 4, "delay_ms": 0})
        assert (await api.wait_run(run.run_id, wait_s=WAIT_S)).status == RunStatus.COMPLETED

    # Accepted (HTTP 200), then cut before any frame: every attempt failed.
    network = Network()
    network.cut_after = lambda frame: True
    network.keep = lambda frame: False
    async with client_for(daemon, desk, transport=network) as client:
        seen = await drain(client.run_events(run.run_id), nth_reconnect(4))
    assert [s.attempt for s in reconnecting(seen)] == [1, 2, 3, 4]

    # Cut after each event: every connection brought a new one, so the backoff starts over.
    network = Network()
    network.cut_after = lambda frame: frame_data(frame) is not None
    async with client_for(daemon, desk, transport=network) as client:
        seen = await drain(client.run_events(run.run_id), lambda i: isinstance(i, RunEvent) and
                           i.type == EventType.COMPLETE)
    events = [i for i in seen if isinstance(i, RunEvent)]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [s.attempt for s in reconnecting(seen)] == [1] * (len(events) - 1)
