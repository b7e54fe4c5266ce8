"""The suite's one reader of the daemon's Server-Sent Events, in three shapes:

- `iter_sse` / `read_sse`: the frames of a response as they arrive (or until a predicate holds);
- `read_until_cut`: raw bytes, dropping the connection at any byte, even mid-frame;
- `Follower`: a stream followed in the background through httpx-sse, as a client application
  does.

The first two share `FrameParser`; `Follower` goes through the library a client would use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import httpx
from httpx_sse import ServerSentEvent, aconnect_sse

from agentd.vocabulary import EventType
from tests.support.daemon import poll_until

# Connect/write quickly or fail; a stream may be quiet for a keepalive period (15 s) and more.
STREAM_TIMEOUT = httpx.Timeout(30.0, read=60.0)
READ_WITHIN_S = 60.0


@dataclass(frozen=True, slots=True)
class Frame:
    """One dispatched SSE event: its id, its event name and its JSON data."""

    id: str | None
    event: str
    data: dict[str, Any]

    @property
    def seq(self) -> int:
        return self.data["seq"]

    @property
    def run_id(self) -> str | None:
        return self.data.get("run_id")

    @property
    def journaled(self) -> bool:
        """A journal event (it has a seq), not a snapshot, lease, presence or state frame."""
        return "seq" in self.data


def parse_frame(raw: bytes) -> Frame | None:
    """An SSE frame without its blank line; None for a comment-only frame (a keepalive)."""
    event_id: str | None = None
    event = "message"
    data: list[str] = []
    for line in raw.decode().split("\n"):
        if not line or line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            event_id = value
        elif name == "event":
            event = value
        elif name == "data":
            data.append(value)
    if not data:
        assert event_id is None and event == "message", f"a frame without data: {raw!r}"
        return None
    return Frame(event_id, event, json.loads("\n".join(data)))


class FrameParser:
    """Bytes in, complete frames out; a partial frame waits in `pending` for its end."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, chunk: bytes) -> list[Frame]:
        self.pending += chunk
        frames: list[Frame] = []
        while (end := self.pending.find(b"\n\n")) >= 0:
            frame = parse_frame(self.pending[:end])
            self.pending = self.pending[end + 2:]
            if frame is not None:
                frames.append(frame)
        return frames


async def iter_sse(response: httpx.Response) -> AsyncIterator[Frame]:
    """The frames of a streaming response as they arrive (keepalive comments skipped)."""
    parser = FrameParser()
    async for chunk in response.aiter_bytes():
        for frame in parser.feed(chunk):
            yield frame


async def read_sse(client: httpx.AsyncClient, path: str, *,
                   stop_after: Callable[[Frame], bool] | None = None,
                   within_s: float = READ_WITHIN_S, headers: dict[str, str] | None = None,
                   params: dict[str, Any] | None = None) -> list[Frame]:
    """Read an SSE stream until it ends or `stop_after(frame)` is true; fail at the deadline."""
    frames: list[Frame] = []
    async with asyncio.timeout(within_s):
        async with client.stream("GET", path, headers=headers, params=params) as response:
            assert response.status_code == 200, (await response.aread())[:500]
            assert response.headers["content-type"].startswith("text/event-stream"), \
                response.headers
            async for frame in iter_sse(response):
                frames.append(frame)
                if stop_after is not None and stop_after(frame):
                    break
    return frames


@dataclass
class Cut:
    """What one connection delivered before it was dropped (or ended by the server)."""

    frames: list[Frame] = field(default_factory=list)
    cut: bool = False  # we dropped it at the byte budget
    mid_frame: bool = False  # dropped with part of a frame received
    satisfied: bool = False  # `until` accepted a frame (then we hung up)


async def read_until_cut(client: httpx.AsyncClient, path: str, *, budget: int | None,
                         params: dict[str, Any] | None = None,
                         headers: dict[str, str] | None = None,
                         exempt_first: bool = False,
                         until: Callable[[Frame], bool] | None = None) -> Cut:
    """Read a stream's complete frames until `budget` body bytes arrived, then hang up — at
    whatever byte that is. With `exempt_first`, the budget starts after the first frame.
    `budget=None` reads until the server ends the stream; `until` hangs up (not a cut) after
    the first frame it accepts.
    """
    out = Cut()
    parser = FrameParser()
    async with client.stream("GET", path, params=params, headers=headers,
                             timeout=STREAM_TIMEOUT) as response:
        if response.status_code != 200:
            await response.aread()
            raise AssertionError(f"GET {path} answered {response.status_code}: "
                                 f"{response.text}")
        assert response.headers["content-type"].startswith("text/event-stream")
        left = budget
        async for chunk in response.aiter_raw():
            if left is not None and (out.frames or not exempt_first):
                if len(chunk) >= left:
                    chunk = chunk[:left]
                    out.cut = True
                left -= len(chunk)
            for frame in parser.feed(chunk):
                out.frames.append(frame)
                if until is not None and until(frame):
                    out.cut, out.satisfied = False, True
                    return out
            if out.cut:
                out.mid_frame = bool(parser.pending)
                break
        # Leaving the block with the body unread closes the connection: the client hung up.
    return out


class Follower:
    """Follows one SSE stream in a background task until the server ends it or we close it."""

    def __init__(self, client: httpx.AsyncClient, path: str, *,
                 params: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None, name: str = "") -> None:
        self._client = client
        self._path = path
        self._params = params
        self._headers = headers
        self.name = name or path
        self.frames: list[Frame] = []
        self.empty: list[ServerSentEvent] = []  # dispatched without data (see _follow)
        self.ended = False
        self._opened = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Follower:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self, within: float = 30.0) -> None:
        self._task = asyncio.create_task(self._follow(), name=f"follow {self.name}")

        async def opened() -> bool:
            self._raise_if_failed()
            return self._opened.is_set()

        await poll_until(opened, within, what=f"{self.name} to open")

    async def _follow(self) -> None:
        async with aconnect_sse(self._client, "GET", self._path, params=self._params,
                                headers=dict(self._headers or {}),
                                timeout=STREAM_TIMEOUT) as source:
            if source.response.status_code != 200:
                await source.response.aread()
                raise AssertionError(f"{self.name} answered {source.response.status_code}: "
                                     f"{source.response.text}")
            self._opened.set()
            async for sse in source.aiter_sse():
                if not sse.data:
                    # Not an event by the SSE spec (empty data is never dispatched), but
                    # httpx-sse 0.4 yields one for a blank line once an id was seen.
                    self.empty.append(sse)
                    continue
                self.frames.append(Frame(sse.id or None, sse.event, sse.json()))
        self.ended = True

    def _raise_if_failed(self) -> None:
        task = self._task
        if task is not None and task.done() and not task.cancelled() and task.exception():
            raise task.exception()  # type: ignore[misc]

    async def wait_for(self, predicate: Callable[[Frame], bool], within: float,
                       what: str) -> Frame:
        """The first frame matching `predicate`, once it arrived."""

        async def arrived() -> Frame | None:
            self._raise_if_failed()
            return next((f for f in self.frames if predicate(f)), None)

        return await poll_until(arrived, within, what=f"{what} on {self.name}")

    async def wait_ended(self, within: float) -> None:
        async def ended() -> bool:
            self._raise_if_failed()
            return self.ended

        await poll_until(ended, within, what=f"{self.name} to end")

    async def close(self) -> None:
        """Hang up (a disconnect, never a stop)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._raise_if_failed()


# -- frames against the journal --------------------------------------------------------------


def of_run(frames: list[Frame], run_id: str) -> list[Frame]:
    """One run's journal events, as a conversation stream delivered them."""
    return [f for f in frames if f.journaled and f.run_id == run_id]


def is_complete(run_id: str | None = None) -> Callable[[Frame], bool]:
    return lambda f: f.event == EventType.COMPLETE and (run_id is None or f.run_id == run_id)


def deltas(frames: list[Frame], run_id: str | None = None) -> str:
    """The answer text as the frames delivered it, for one run (feeds) or the only run."""
    return "".join(f.data["delta"] for f in frames if f.event == EventType.CONTENT_DELTA
                   and (run_id is None or f.run_id == run_id))


def as_journal(frames: list[Frame]) -> list[tuple[int, str, dict[str, Any]]]:
    """Frames as (seq, type, payload) rows, to compare with the journal."""
    out = []
    for f in frames:
        payload = {k: v for k, v in f.data.items() if k not in ("seq", "type")}
        out.append((f.seq, f.event, payload))
    return out


def journal_rows(rows: list[asyncpg.Record],
                 feed_run_id: str | None = None) -> list[tuple[int, str, dict[str, Any]]]:
    """Journal rows as a stream shows them; a conversation feed adds each event's run_id."""
    extra = {"run_id": feed_run_id} if feed_run_id else {}
    return [(r["seq"], r["type"], {**r["payload"], **extra}) for r in rows]
