"""An idle stream stays warm with keepalive comments, and a comment is never an event: clients
built on httpx-sse (the library agenttui and scripts stream with) see nothing from it — no empty
event to choke on, so no reason to reconnect (and re-attach) every keepalive period.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent

from tests.streams.helpers import get_run, post_run
from tests.support.daemon import poll_until
from tests.support.factories import create_conversation, new_device
from tests.support.sse import STREAM_TIMEOUT

KEEPALIVES = 3


class Tee:
    """The response as httpx-sse reads it, counting the keepalive comments that pass through."""

    def __init__(self, response: httpx.Response) -> None:
        self.headers = response.headers
        self._response = response
        self.keepalives = 0

    async def aiter_text(self) -> AsyncIterator[str]:
        async for text in self._response.aiter_text():
            self.keepalives += text.count(": keepalive")
            yield text


async def events_until_keepalives(client: httpx.AsyncClient, path: str,
                                  **kwargs: Any) -> tuple[list[ServerSentEvent], int]:
    """Everything httpx-sse dispatches on a stream until KEEPALIVES comments went through it."""
    seen: list[ServerSentEvent] = []
    async with client.stream("GET", path, timeout=STREAM_TIMEOUT, **kwargs) as response:
        assert response.status_code == 200
        tee = Tee(response)

        async def decode() -> None:
            async for sse in EventSource(tee).aiter_sse():  # type: ignore[arg-type]
                seen.append(sse)

        decoding = asyncio.create_task(decode())
        try:
            async def warm() -> bool:
                if decoding.done():
                    decoding.result()
                    raise AssertionError(f"{path} ended")
                return tee.keepalives >= KEEPALIVES

            # Text is decoded as soon as the tee hands it on, so once the count is reached
            # every comment counted has been through the decoder.
            await poll_until(warm, 30, what=f"{KEEPALIVES} keepalives on {path}")
        finally:
            decoding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await decoding
    return seen, tee.keepalives


async def test_keepalive_comments_are_not_events(spawn_daemon, pool):
    daemon = spawn_daemon(keepalive_s=1)
    await daemon.wait_ready()
    laptop = await new_device(pool, "a", "laptop")
    async with laptop.client(daemon) as client, asyncio.timeout(120):
        quiet = await create_conversation(client)
        busy = await create_conversation(client)
        # A run that streams nothing for a while: queued behind a long one.
        await post_run(client, busy, "hold the line", tokens=2000, delay_ms=10)
        idle = (await post_run(client, busy, "wait your turn", tokens=1))["run_id"]

        (feed, feed_keepalives), (run, run_keepalives) = await asyncio.gather(
            events_until_keepalives(client, f"/v1/conversations/{quiet}/events"),
            events_until_keepalives(client, f"/v1/runs/{idle}/events"))
        assert (await get_run(client, idle))["status"] == "queued", "the run was not idle"

    assert feed_keepalives >= KEEPALIVES and run_keepalives >= KEEPALIVES
    assert [e for e in feed + run if not e.data] == [], "a keepalive became an event"
    assert feed and feed[0].event == "snapshot"
    assert [e.event for e in run] == ["user_message", "run_queued"]
