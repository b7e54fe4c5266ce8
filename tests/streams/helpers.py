"""What stream tests share: devices with their own HTTP clients, turns posted through the API, and
two SSE readers — `Follower` follows a stream in the background through httpx-sse (as a client
application does), `read_until_cut` reads raw bytes and drops the connection at any byte, even in
the middle of a frame.

Everything is observed over HTTP or through the test's own database connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import asyncpg
import httpx
from httpx_sse import ServerSentEvent, aconnect_sse

from agentd.accounts import create_device_token
from agentd.vocabulary import EventType, RunStatus
from tests.daemon_harness import Daemon, poll_until

# Connect/write quickly or fail; a stream may be quiet for a keepalive period (15 s) and more.
STREAM_TIMEOUT = httpx.Timeout(30.0, read=60.0)
TERMINAL = {str(s) for s in RunStatus if s.terminal}


@dataclass(frozen=True, slots=True)
class Device:
    """A device credential of an account: each has its own bearer token."""

    name: str
    token: str
    device_id: UUID

    def client(self, daemon: Daemon) -> httpx.AsyncClient:
        return daemon.client(timeout=STREAM_TIMEOUT,
                             headers={"Authorization": f"Bearer {self.token}"})


async def new_device(pool: asyncpg.Pool, account: str, name: str) -> Device:
    token, device_id = await create_device_token(pool, account=account, device=name)
    return Device(name, token, device_id)


async def create_conversation(client: httpx.AsyncClient, title: str = "streams") -> str:
    response = await client.post("/v1/conversations", json={"title": title})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def run_body(content: str, *, tokens: int, delay_ms: int = 0,
             on_busy: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"content": content, "model": "demo",
                            "params": {"tokens": tokens, "delay_ms": delay_ms}}
    if on_busy is not None:
        body["on_busy"] = on_busy
    return body


async def post_run(client: httpx.AsyncClient, conversation_id: str, content: str, *,
                   tokens: int, delay_ms: int = 0, on_busy: str | None = None) -> dict[str, Any]:
    """POST a demo turn; asserts the 202 and returns its body."""
    response = await client.post(f"/v1/conversations/{conversation_id}/runs",
                                 json=run_body(content, tokens=tokens, delay_ms=delay_ms,
                                               on_busy=on_busy))
    assert response.status_code == 202, response.text
    body = response.json()
    assert response.headers["Location"] == f"/v1/runs/{body['run_id']}"
    return body


async def get_run(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/runs/{run_id}")
    assert response.status_code == 200, response.text
    return response.json()


async def wait_terminal(client: httpx.AsyncClient, run_id: str, within: float) -> dict[str, Any]:
    """The run row once terminal, through the API's own NOTIFY-driven `wait`."""

    async def finished() -> dict[str, Any] | None:
        response = await client.get(f"/v1/runs/{run_id}/wait", params={"timeout": 5})
        assert response.status_code == 200, response.text
        run = response.json()
        return run if run["status"] in TERMINAL else None

    return await poll_until(finished, within, interval=0, what=f"run {run_id} to end")


async def wait_status(client: httpx.AsyncClient, run_id: str, status: str,
                      within: float) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        run = await get_run(client, run_id)
        return run if run["status"] == status else None

    return await poll_until(reached, within, what=f"run {run_id} to be {status}")


async def get_conversation(client: httpx.AsyncClient, conversation_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/conversations/{conversation_id}")
    assert response.status_code == 200, response.text
    return response.json()


async def journal(pool: asyncpg.Pool, run_id: str | UUID) -> list[asyncpg.Record]:
    return await pool.fetch("SELECT seq, type, payload FROM run_event WHERE run_id = $1"
                            " ORDER BY seq", UUID(str(run_id)))


async def journaled_deltas(pool: asyncpg.Pool, run_id: str | UUID) -> int:
    return await pool.fetchval("SELECT count(*) FROM run_event WHERE run_id = $1"
                               " AND type = 'content_delta'", UUID(str(run_id)))


async def assistant_message(pool: asyncpg.Pool, run_id: str | UUID) -> asyncpg.Record:
    rows = await pool.fetch("SELECT id, content, status FROM message WHERE run_id = $1"
                            " AND role = 'assistant'", UUID(str(run_id)))
    assert len(rows) == 1, f"run {run_id} has {len(rows)} assistant messages"
    return rows[0]


# -- SSE ------------------------------------------------------------------------------------


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
    async with client.stream("GET", path, params=params, headers=headers,
                             timeout=STREAM_TIMEOUT) as response:
        if response.status_code != 200:
            await response.aread()
            raise AssertionError(f"GET {path} answered {response.status_code}: "
                                 f"{response.text}")
        assert response.headers["content-type"].startswith("text/event-stream")
        buffer = b""
        left = budget
        async for chunk in response.aiter_raw():
            if left is not None and (out.frames or not exempt_first):
                if len(chunk) >= left:
                    chunk = chunk[:left]
                    out.cut = True
                left -= len(chunk)
            buffer += chunk
            while (end := buffer.find(b"\n\n")) >= 0:
                frame = parse_frame(buffer[:end])
                buffer = buffer[end + 2:]
                if frame is not None:
                    out.frames.append(frame)
                    if until is not None and until(frame):
                        out.cut, out.satisfied = False, True
                        return out
            if out.cut:
                out.mid_frame = bool(buffer)
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
