"""Presence: while a device holds a conversation stream it is attached — GET shows it and every
conversation stream is pushed a `presence` event — and it is gone as soon as its stream ends.
Every (re)connect starts with the state snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
from uuid import UUID

from tests.support.daemon import poll_until
from tests.support.factories import create_conversation, new_device
from tests.support.sse import Follower, Frame


def names(attached: list[dict[str, Any]]) -> list[str]:
    return [a["device"] for a in attached]


def presence_of(*devices: str):
    return lambda f: f.event == "presence" and names(f.data["attached"]) == list(devices)


async def assert_snapshot_first(follower: Follower, conversation_id: str) -> Frame:
    # Open means the headers came: the first frame may still be on its way.
    await follower.wait_for(lambda _frame: True, 30, "the first frame")
    first = follower.frames[0]
    assert first.event == "snapshot", f"{follower.name} began with {first.event}"
    assert first.data["conversation"]["id"] == conversation_id
    assert first.id, "the snapshot carries no cursor"
    return first


async def test_attached_devices_follow_open_conversation_streams(spawn_daemon, pool):
    daemon = spawn_daemon()
    await daemon.wait_ready()
    laptop = await new_device(pool, "a", "laptop")
    phone = await new_device(pool, "a", "phone")
    async with laptop.client(daemon) as on_laptop, phone.client(daemon) as on_phone, \
            asyncio.timeout(120):
        conversation = await create_conversation(on_laptop)
        feed = f"/v1/conversations/{conversation}/events"

        async def attached_are(*devices: str) -> tuple[list[dict[str, Any]]] | None:
            """(attached,) when exactly `devices` are attached (a tuple: truthy when empty)."""
            response = await on_phone.get(f"/v1/conversations/{conversation}")
            assert response.status_code == 200, response.text
            attached = response.json()["attached"]
            return (attached,) if names(attached) == list(devices) else None

        async def presence_rows(count: int) -> bool:
            return await pool.fetchval("SELECT count(*) FROM presence WHERE conversation_id"
                                       " = $1", UUID(conversation)) == count

        assert await attached_are()

        async with Follower(on_laptop, feed, name="laptop feed") as laptop_feed, \
                contextlib.AsyncExitStack() as phone_streams:
            await assert_snapshot_first(laptop_feed, conversation)
            await laptop_feed.wait_for(presence_of("laptop"), 30, "presence [laptop]")

            phone_feed = await phone_streams.enter_async_context(
                Follower(on_phone, feed, name="phone feed"))
            snapshot = await assert_snapshot_first(phone_feed, conversation)
            assert names(snapshot.data["conversation"]["attached"]) == ["laptop"]
            for follower in (laptop_feed, phone_feed):
                await follower.wait_for(presence_of("laptop", "phone"), 30,
                                        "presence [laptop, phone]")
            [both] = await poll_until(lambda: attached_are("laptop", "phone"), 30,
                                      what="two attached devices")
            assert [a["device_id"] for a in both] == [str(laptop.device_id),
                                                     str(phone.device_id)]
            assert all(a["since"] for a in both)

            # The laptop hangs up: it is detached, and the phone's stream is told so.
            await laptop_feed.close()
            await poll_until(lambda: attached_are("phone"), 30, what="only the phone attached")
            await phone_feed.wait_for(presence_of("phone"), 30, "presence [phone]")

            # The phone rejoins on a second stream by its cursor, both ways: each connection
            # starts with a snapshot; the device is attached once however many streams it has.
            cursor = phone_feed.frames[-1].id
            for how in ({"headers": {"Last-Event-ID": cursor}}, {"params": {"cursor": cursor}}):
                async with Follower(on_phone, feed, name=f"phone feed again {how}",
                                    **how) as again:
                    resumed = await assert_snapshot_first(again, conversation)
                    assert resumed.id == cursor
                    assert names(resumed.data["conversation"]["attached"]) == ["phone"]
                    await poll_until(lambda: presence_rows(2), 30, what="two phone streams")
                    assert await attached_are("phone")
                await poll_until(lambda: presence_rows(1), 30, what="one phone stream")
                assert await attached_are("phone")
        await poll_until(lambda: attached_are(), 30, what="no attached device")
        await poll_until(lambda: presence_rows(0), 30, what="no presence row")

    presences = [names(f.data["attached"]) for f in laptop_feed.frames if f.event == "presence"]
    assert presences == [["laptop"], ["laptop", "phone"]], presences
    presences = [names(f.data["attached"]) for f in phone_feed.frames if f.event == "presence"]
    assert presences[0] == ["laptop", "phone"] and presences[-1] == ["phone"], presences
