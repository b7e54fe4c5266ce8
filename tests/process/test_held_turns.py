"""A queued turn held back starts as soon as what held it ends, without waiting for the claim
loop's poll: held by its conversation's running turn or by its account's running limit (also
when two turns end close together), the ending's wake to the daemon's own idle claim loop starts
it (notifier.py), and so does raising the limit (its statement wakes every claim loop); held by
the daemon's slots, the slot coming back does. The daemon's poll is an hour away throughout, so
a turn that waited for it would never start within the test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from uuid import UUID

import asyncpg
from prometheus_client.parser import text_string_to_metric_families

from agentd.accounts import LimitChange, set_account_limits
from tests.process.helpers import wait_status
from tests.support.daemon import poll_until
from tests.support.factories import create_conversation, new_device

LONG = {"tokens": 10, "delay_ms": 100}  # about a second: the held turn is posted meanwhile
LONGER = {"tokens": 30, "delay_ms": 100}  # still running well after a LONG turn ended
SHORT = {"tokens": 2, "delay_ms": 0}


async def post_turn(client, conversation: str, params: dict[str, int]) -> dict:
    response = await client.post(f"/v1/conversations/{conversation}/runs",
                                 json={"content": "go", "params": params})
    assert response.status_code == 202, response.text
    return response.json()


async def claims_made(daemon) -> float:
    """Claim statements the daemon has made (beside posts and in its loop)."""
    scraped = await daemon.request("GET", "/metrics")
    family = next(f for f in text_string_to_metric_families(scraped.text)
                  if f.name == "agentd_claim_batch_size")
    return next(s.value for s in family.samples if s.name.endswith("_count"))


async def _at_least(daemon, count: float) -> bool:
    return await claims_made(daemon) >= count


async def running_turn(pool, client, conversation: str, params: dict[str, int]) -> dict:
    """Post a turn and wait until it runs (its 202 may say queued: a claim woken by a limit
    change can hold the account's slot while the post looks)."""
    created = await post_turn(client, conversation, params)
    await wait_status(pool, UUID(created["run_id"]), "running", timeout=30)
    return created


async def held_then_started(pool, client, holders: list[dict], conversation: str) -> None:
    """Post a turn while `holders` run: it must be queued, then run once they have ended."""
    held = await post_turn(client, conversation, SHORT)
    assert held["status"] == "queued", ("not held back: the turns holding it ended too soon",
                                        held)
    for holder in holders:
        await wait_status(pool, UUID(holder["run_id"]), "completed", timeout=30)
    row = await wait_status(pool, UUID(held["run_id"]), "completed", timeout=30)
    assert row["error"] is None


@contextlib.asynccontextmanager
async def fleet_view(dsn: str) -> AsyncIterator[Callable[[], Awaitable[list[str]]]]:
    """Another process's view of the claim loops' channel: the payloads heard so far, read up
    to a marker sent now (NOTIFYs arrive in commit order)."""
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(dsn)
    await listener.add_listener("agentd_run_enqueued", lambda *args: heard.put_nowait(args[3]))

    async def so_far() -> list[str]:
        await listener.execute("SELECT pg_notify('agentd_run_enqueued', 'marker')")
        payloads = []
        async with asyncio.timeout(15):
            while (payload := await heard.get()) != "marker":
                payloads.append(payload)
        return payloads

    try:
        yield so_far
    finally:
        await listener.close()


async def test_a_held_turn_starts_when_what_held_it_ends(spawn_daemon, pool, dsn):
    # Three slots: until the last case a slot stays free, so the held turn is started by the
    # ending's wake to the idle claim loop, not by a slot coming back to a loop waiting for one.
    daemon = spawn_daemon(tick_s=3600, max_runs=3)
    await daemon.wait_ready()
    device = await new_device(pool, "held", "laptop")
    async with device.client(daemon) as client, fleet_view(dsn) as heard_so_far:
        one, two, three, four = [await create_conversation(client) for _ in range(4)]

        # Its conversation's turn runs. The fleet hears the held turn's enqueue, not the
        # ending that freed it: that went to the daemon's own claim loop alone.
        first = await running_turn(pool, client, one, LONG)
        await held_then_started(pool, client, [first], one)
        assert await heard_so_far() == [one]

        # Its account is at its running limit (here 1), with turns of other conversations.
        await set_account_limits(pool, "held", LimitChange(change_running=True, max_running=1))
        first = await running_turn(pool, client, one, LONG)
        await held_then_started(pool, client, [first], two)

        # Its account's limit is raised while the turn holding it still runs.
        first = await running_turn(pool, client, one, {"tokens": 30, "delay_ms": 100})
        claims = await claims_made(daemon)
        held = await post_turn(client, two, SHORT)
        assert held["status"] == "queued"
        # Raised only once the claims the post made are over (the one beside it, and the
        # loop's, woken by it): a claim still to come would take the turn by itself.
        await poll_until(lambda: _at_least(daemon, claims + 2), 30,
                         what="the post's two claims to find nothing")
        await set_account_limits(pool, "held", LimitChange(change_running=True, max_running=2))
        row = await wait_status(pool, UUID(held["run_id"]), "completed", timeout=30)
        ended = await wait_status(pool, UUID(first["run_id"]), "completed", timeout=30)
        assert row["started_at"] < ended["finished_at"], "it waited for the turn to end"

        # At that limit of 2, the two running turns ending close together: after both,
        # nothing runs.
        first, second = [await running_turn(pool, client, c, LONG) for c in (one, two)]
        await held_then_started(pool, client, [first, second], three)

        # The daemon's slots are all taken (max_runs 3), the account far below its limit:
        # the slot that comes back starts it. The other two run on a while after it.
        await set_account_limits(pool, "held", LimitChange(change_running=True, max_running=None))
        holders = [await running_turn(pool, client, one, LONG),
                   *[await running_turn(pool, client, c, LONGER) for c in (two, three)]]
        await held_then_started(pool, client, holders, four)
        # The claim the returning slot woke was sent after the ending committed, so it acted
        # for the ending's wake: nothing was handed on to the fleet (dispatcher.py), though
        # the daemon was full again right after it.
        heard = await heard_so_far()
        assert not {"no free slot", "overloaded", "claim failed"} & set(heard), heard


async def test_a_turn_held_by_the_limit_starts_when_the_running_ones_conversation_is_deleted(
        spawn_daemon, pool) -> None:
    """Deleting a conversation removes its running turn with it, which frees its account's
    running slot; the delete woke no claim loop, so a turn of another conversation that the
    limit held back waited for the poll (an hour away here)."""
    daemon = spawn_daemon(tick_s=3600, max_runs=3)
    await daemon.wait_ready()
    device = await new_device(pool, "deleting", "laptop")
    await set_account_limits(pool, "deleting", LimitChange(change_running=True, max_running=1))
    async with device.client(daemon) as client:
        doomed, other = [await create_conversation(client) for _ in range(2)]
        await running_turn(pool, client, doomed, {"tokens": 300, "delay_ms": 100})
        held = await post_turn(client, other, SHORT)
        assert held["status"] == "queued", held
        deleted = await client.delete(f"/v1/conversations/{doomed}")
        assert deleted.status_code == 204, deleted.text
        row = await wait_status(pool, UUID(held["run_id"]), "completed", timeout=30)
        assert row["error"] is None
