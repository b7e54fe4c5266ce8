"""What the TUI tests share: devices, apps driven by Pilot, and transports that misbehave on cue.

`Valve` sits between a client and the daemon and lets a test cut the event streams, refuse new
ones, or hold frames back (a frozen but open connection); `Chaos` cuts every stream at a random
byte. Both pass real bytes from a real daemon: nothing is simulated but the broken network.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from agenttui.client import AgentClient, Backoff
from agenttui.drafts import DraftLedger
from agenttui.settings import Settings
from tests.support.daemon import Daemon
from tests.support.factories import Device

SNAPSHOT_DIR = Path(__file__).parent / "snapshots"
TERMINAL_SIZE = (110, 30)
WAIT_S = 60.0  # generous: other suites run on the same two cores


def is_stream(request: httpx.Request) -> bool:
    return request.headers.get("accept") == "text/event-stream"


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _Gate(httpx.AsyncByteStream):
    """One response body, forwarded frame by frame under the valve's control."""

    def __init__(self, inner: httpx.AsyncByteStream, valve: Valve) -> None:
        self.inner = inner
        self.valve = valve
        self.cut = asyncio.Event()

    async def _next_or_cut(self, awaitable: Awaitable[Any]) -> Any:
        task = asyncio.ensure_future(awaitable)
        cut = asyncio.ensure_future(self.cut.wait())
        try:
            done, _ = await asyncio.wait({task, cut}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            task.add_done_callback(_retrieve)  # closed while waiting: the read dies unseen
            raise
        finally:
            cut.cancel()
        if task not in done:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise httpx.ReadError("connection cut by the test")
        return task.result()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = self.inner.__aiter__()
        buffer = b""
        while True:
            try:
                chunk = await self._next_or_cut(chunks.__anext__())
            except StopAsyncIteration:
                break
            buffer += chunk
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                await self._next_or_cut(self.valve.flowing.wait())
                self.valve.frames.append(frame)
                yield frame + b"\n\n"
                if self.valve.hold_when is not None and self.valve.hold_when(frame):
                    self.valve.hold_when = None
                    self.valve.hold()
        if buffer:
            yield buffer

    async def aclose(self) -> None:
        self.valve.gates.discard(self)
        await self.inner.aclose()


class Valve(httpx.AsyncBaseTransport):
    """A real HTTP transport whose event streams a test can cut, refuse or hold."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.gates: set[_Gate] = set()
        self.accepting = asyncio.Event()
        self.accepting.set()
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.hold_when: Callable[[bytes], bool] | None = None
        self.frames: list[bytes] = []
        self.stream_requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not is_stream(request):
            return await self.inner.handle_async_request(request)
        self.stream_requests += 1
        await self.accepting.wait()  # "down": a new stream hangs as if the host were gone
        response = await self.inner.handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        gate = _Gate(response.stream, self)
        self.gates.add(gate)
        return httpx.Response(response.status_code, headers=response.headers, stream=gate,
                              extensions=response.extensions)

    def cut(self) -> None:
        for gate in list(self.gates):
            gate.cut.set()

    def down(self) -> None:
        self.accepting.clear()

    def up(self) -> None:
        self.accepting.set()

    def hold(self) -> None:
        self.flowing.clear()

    def release(self) -> None:
        self.flowing.set()

    def hold_after(self, event: str, *, contains: str | None = None) -> None:
        """Freeze the streams right after the next frame of this event type."""
        marker = f"event: {event}\n".encode()

        def matches(frame: bytes) -> bool:
            return marker in frame + b"\n" and (contains is None or contains.encode() in frame)

        self.hold_when = matches

    async def aclose(self) -> None:
        await self.inner.aclose()


class _ChaosStream(httpx.AsyncByteStream):
    """Dies `after` bytes past the end of the first frame, or inside it (`after` < 0)."""

    def __init__(self, inner: httpx.AsyncByteStream, after: int) -> None:
        self.inner = inner
        self.after = after

    async def __aiter__(self) -> AsyncIterator[bytes]:
        received = b""
        cut_at = -self.after if self.after < 0 else None
        async for chunk in self.inner:
            received += chunk
            if cut_at is None and b"\n\n" in received:
                cut_at = received.index(b"\n\n") + 2 + self.after
            if cut_at is not None and len(received) >= cut_at:
                yield chunk[: len(chunk) - (len(received) - cut_at)]  # dies mid-chunk
                raise httpx.ReadError("connection reset (chaos)")
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class Chaos(httpx.AsyncBaseTransport):
    """Cuts every event stream at a random byte (seeded): now and then inside the first frame
    (the snapshot), mostly somewhat after it, mid-frame or between frames."""

    seed: int
    inner: httpx.AsyncHTTPTransport = field(default_factory=httpx.AsyncHTTPTransport)
    cuts: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not is_stream(request) or response.status_code != 200:
            return response
        assert isinstance(response.stream, httpx.AsyncByteStream)
        self.cuts += 1
        after = -self.rng.randint(1, 150) if self.rng.random() < 0.2 else \
            self.rng.randint(1, 900)
        return httpx.Response(200, headers=response.headers,
                              stream=_ChaosStream(response.stream, after),
                              extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


FAST_BACKOFF = Backoff(initial=0.05, maximum=0.5)


def client_for(daemon: Daemon | str, device: Device, *,
               transport: httpx.AsyncBaseTransport | None = None) -> AgentClient:
    url = daemon if isinstance(daemon, str) else daemon.url
    return AgentClient(url, device.token, trust_env=False, transport=transport,
                       backoff=FAST_BACKOFF, timeout=30.0, stream_timeout=60.0)


def tui_settings(url: str, device: Device, **overrides: Any) -> Settings:
    return Settings(url=url, token=device.token, device=device.name, **overrides)


@contextlib.asynccontextmanager
async def running_tui(url: str, device: Device, state_dir: Path, *,
                      transport: httpx.AsyncBaseTransport | None = None,
                      size: tuple[int, int] = TERMINAL_SIZE, notifications: bool = False,
                      **settings: Any) -> AsyncIterator[Any]:
    """An app for `device` on a live daemon, driven by Pilot: yields (app, pilot). Toasts are
    drawn only with `notifications=True`."""
    from agenttui.app import make_app

    client = client_for(url, device, transport=transport)
    ledger = DraftLedger(state_dir / f"drafts-{device.name}.json")
    app = make_app(tui_settings(url, device, **settings), client, drafts=ledger)
    try:
        async with app.run_test(size=size, notifications=notifications) as pilot:
            yield app, pilot
    finally:
        await client.aclose()


async def wait_for(pilot: Any, predicate: Callable[[], Any], what: str,
                   within: float = WAIT_S) -> Any:
    """Let the app work (pilot.pause) until `predicate()` is truthy; fail at the deadline."""
    deadline = time.monotonic() + within
    while True:
        expired = time.monotonic() >= deadline
        await pilot.pause(0.02)
        value = predicate()
        if value:
            return value
        if expired:
            raise AssertionError(f"timed out after {within:g}s waiting for {what}")


async def search_for(app: Any, pilot: Any, words: str) -> Any:
    """Open the search screen (Ctrl+F), search `words`, return the screen once it has hits."""
    from textual.widgets import Input

    from agenttui.screens.search import SearchScreen

    await pilot.press("ctrl+f")
    await wait_for(pilot, lambda: isinstance(app.screen, SearchScreen), "the search screen")
    search = app.screen
    search.query_one(Input).value = words
    await pilot.press("enter")
    await wait_for(pilot, lambda: search.hits, "search results")
    return search


def screen_text(app: Any) -> str:
    """What the screen shows, as plain text: the render `export_screenshot` makes, as text."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True,
                      color_system="truecolor", record=True, legacy_windows=False,
                      safe_box=False)
    console.print(app.screen._compositor.render_update(
        full=True, screen_stack=app._background_screens))
    return console.export_text()


# -- SVG snapshots ---------------------------------------------------------------------------

_UNIQUE = re.compile(r"terminal-\d+")


def normalize_svg(svg: str) -> str:
    """Rich names its CSS classes after a hash of the content; compare the content itself."""
    return _UNIQUE.sub("terminal", svg).strip()


def assert_snapshot(app: Any, name: str, tmp_path: Path, update: bool) -> None:
    """Compare the screen with tests/tui/snapshots/<name>.svg (write it when updating)."""
    svg = app.export_screenshot(title=f"agenttui · {name}")
    expected_path = SNAPSHOT_DIR / f"{name}.svg"
    if update or not expected_path.exists():
        SNAPSHOT_DIR.mkdir(exist_ok=True)
        expected_path.write_text(svg, "utf-8")
        if not update:
            raise AssertionError(f"no snapshot {expected_path.name} yet: wrote it; review it and "
                                 f"run again")
        return
    if normalize_svg(svg) != normalize_svg(expected_path.read_text("utf-8")):
        actual = tmp_path / f"{name}.actual.svg"
        actual.write_text(svg, "utf-8")
        raise AssertionError(f"screen differs from {expected_path}: see {actual} (update with "
                             f"SNAPSHOT_UPDATE=1 after checking it)")


def is_post_run(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.endswith("/runs")


class Posts(httpx.AsyncBaseTransport):
    """A real transport to the daemon that can hold posted turns back, lose the daemon's answer
    to them after it has handled them, refuse them, or refuse a conversation feed once."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.released = asyncio.Event()
        self.released.set()
        self.held = 0  # posts waiting for release()
        self.lose_answers = False
        self.garble_answers = False  # answer handled posts with a page that is not agentd's
        self.lose_for: set[str] = set()  # lose the answers to posts of these texts only
        self.refuse_posts = 0  # posts to refuse (a 422) before they reach the daemon
        self.keys: list[str] = []  # the Idempotency-Key of every post, in order
        self.refuse_feeds = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if is_stream(request) and self.refuse_feeds:
            self.refuse_feeds -= 1
            return httpx.Response(403, json={"error": {"code": "forbidden",
                                                       "message": "refused by the test"}})
        if not is_post_run(request):
            return await self.inner.handle_async_request(request)
        self.keys.append(request.headers["idempotency-key"])
        if self.refuse_posts:
            self.refuse_posts -= 1
            return httpx.Response(422, json={"error": {"code": "invalid_params",
                                                       "message": "refused by the test"}})
        if not self.released.is_set():
            self.held += 1
            await self.released.wait()  # a slow daemon (or create_run's own retries)
        response = await self.inner.handle_async_request(request)
        if self.lose_answers or json.loads(request.content).get("content") in self.lose_for:
            await response.aread()  # the daemon did the work; its answer never arrives
            await response.aclose()
            raise httpx.ReadError("the answer was lost (test)")
        if self.garble_answers:  # a proxy's page in place of the daemon's answer
            await response.aread()
            await response.aclose()
            return httpx.Response(202, text="<html>signed out</html>",
                                  headers={"Content-Type": "text/html"})
        return response

    def hold(self) -> None:
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    async def aclose(self) -> None:
        await self.inner.aclose()
