"""Revocation bites live streams: a revoked device's open streams (a run's and a conversation's)
end within one keepalive interval with a final `error` event, and its presence leaves every
other device's feed — whether the revocation's hint arrives or only the poll finds it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from uuid import UUID

import asyncpg
import pytest

from agenttui.client import AgentClient, ConnectionState, ConnectionStatus, Unauthorized
from tests.remote.helpers import SpawnRemote
from tests.streams.helpers import post_run
from tests.support.daemon import poll_until
from tests.support.factories import create_conversation, new_device
from tests.support.sse import Follower, Frame

KEEPALIVE_S = 2.0
BOUND_S = KEEPALIVE_S + 1.0  # what the product promises: one keepalive interval (+ slack)


def attached_are(*names: str):
    return lambda f: f.event == "presence" and [a["device"] for a in f.data["attached"]] \
        == list(names)


def revoked_ending(follower: Follower) -> Frame:
    last = follower.frames[-1]
    assert last.event == "error", f"{follower.name} ended with {last.event}: {last.data}"
    assert last.data == {"type": "error", "error": {
        "code": "device_revoked", "message": last.data["error"]["message"]}}
    return last


async def ends_within(followers: list[Follower], since: float, bound: float) -> None:
    left = bound - (time.monotonic() - since)
    for follower in followers:
        await follower.wait_ended(max(left, 0.0))
        left = bound - (time.monotonic() - since)
    elapsed = time.monotonic() - since
    assert elapsed <= bound, f"streams ended {elapsed:.2f}s after the revocation"


async def follow_with_agenttui(url: str, token: str, conversation_id: str) -> list[Any]:
    """The TUI's own stream: it must stop (not reconnect) once the device is revoked."""
    seen: list[Any] = []
    async with AgentClient(url, token, trust_env=False) as client:
        try:
            async for item in client.conversation_events(conversation_id):
                seen.append(item)
        except Unauthorized as exc:
            seen.append(exc)
    return seen


@pytest.mark.parametrize("how", ["the API (with its hint)", "a bare UPDATE (poll only)"])
async def test_revoking_a_device_ends_its_streams_and_its_presence(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool, how: str) -> None:
    daemon = spawn_remote(keepalive_s=KEEPALIVE_S)
    await daemon.wait_ready()
    laptop = await new_device(pool, "alice", "laptop")
    phone = await new_device(pool, "alice", "phone")
    async with laptop.client(daemon) as on_laptop, phone.client(daemon) as on_phone, \
            asyncio.timeout(120):
        conversation = await create_conversation(on_laptop)
        feed = f"/v1/conversations/{conversation}/events"
        turn = await post_run(on_phone, conversation, "a long answer", tokens=1000,
                              delay_ms=200)
        async with Follower(on_laptop, feed, name="laptop feed") as laptop_feed, \
                Follower(on_phone, feed, name="phone feed") as phone_feed, \
                Follower(on_phone, f"/v1/runs/{turn['run_id']}/events",
                         name="phone run stream") as phone_run:
            tui = asyncio.create_task(follow_with_agenttui(daemon.url, phone.token,
                                                           conversation))
            await laptop_feed.wait_for(attached_are("laptop", "phone"), 30, "both attached")
            await phone_run.wait_for(lambda f: f.event == "content_delta", 30, "a delta")

            revoked_at = time.monotonic()
            if how.startswith("the API"):
                answer = await on_laptop.delete(f"/v1/devices/{phone.device_id}")
                assert answer.status_code == 200, answer.text
            else:
                # No NOTIFY, no presence cleanup: only the daemon's poll can notice this.
                await pool.execute("UPDATE device SET revoked_at = clock_timestamp() "
                                   "WHERE id = $1", phone.device_id)
            await ends_within([phone_feed, phone_run], revoked_at, BOUND_S)
            revoked_ending(phone_feed)
            revoked_ending(phone_run)
            await laptop_feed.wait_for(attached_are("laptop"), BOUND_S, "the phone gone")
            assert not laptop_feed.ended  # the other device streams on

            seen = await asyncio.wait_for(tui, BOUND_S + 5)
            assert isinstance(seen[-1], Unauthorized) and seen[-1].code == "device_revoked"
            closed = [s for s in seen if isinstance(s, ConnectionStatus)
                      and s.state == ConnectionState.CLOSED]
            assert len(closed) == 1  # gave up at once: no reconnect loop on a revoked token

        assert await pool.fetchval("SELECT count(*) FROM presence WHERE device_id = $1",
                                   UUID(str(phone.device_id))) == 0
        # Revoking a device does not stop the turn it asked for: that is what Stop is for.
        run = (await on_laptop.get(f"/v1/runs/{turn['run_id']}")).json()
        assert run["status"] == "running" and not run["cancel_requested"]
        await on_laptop.post(f"/v1/runs/{turn['run_id']}/cancel")


async def test_a_revoked_device_cannot_open_a_stream(spawn_remote: SpawnRemote,
                                                     pool: asyncpg.Pool) -> None:
    daemon = spawn_remote(keepalive_s=KEEPALIVE_S)
    await daemon.wait_ready()
    phone = await new_device(pool, "alice", "phone")
    async with phone.client(daemon) as on_phone:
        conversation = await create_conversation(on_phone)
        await pool.execute("UPDATE device SET revoked_at = clock_timestamp() WHERE id = $1",
                           phone.device_id)
        response = await on_phone.get(f"/v1/conversations/{conversation}/events")
        assert response.status_code == 401

    async def no_presence() -> bool:
        return await pool.fetchval("SELECT count(*) FROM presence") == 0

    await poll_until(no_presence, 5, what="no presence row")
