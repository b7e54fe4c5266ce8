"""Rule 6: NOTIFY wakes the dispatcher at once; without the hub it degrades to the tick, and the
hub comes back on its own (same process), bringing the fast path back with it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta

import asyncpg
import pytest

from tests.process.helpers import STARTED, wait_status
from tests.support.daemon import Daemon, poll_until, with_user
from tests.support.factories import enqueue_demo, new_account, new_conversation

HUB_BACKENDS = ("SELECT pid FROM pg_stat_activity"
                " WHERE application_name = 'agentd-hub' AND datname = current_database()")
TERMINATE_HUB = ("SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                 " WHERE application_name = 'agentd-hub' AND datname = current_database()")


def claim_latency(row: asyncpg.Record) -> timedelta:
    """Enqueue -> claim, both stamped by the database clock."""
    return row["started_at"] - row["created_at"]


async def hub_state(daemon: Daemon) -> bool:
    return (await daemon.readyz())["hub"]


async def wait_hub(daemon: Daemon, up: bool, within: float) -> None:
    async def reached() -> bool:
        return await hub_state(daemon) is up

    await poll_until(reached, within, what=f"readyz to report the hub {'up' if up else 'down'}")


async def test_run_enqueued_while_idle_is_claimed_by_notify_not_the_tick(spawn_daemon, pool):
    daemon = spawn_daemon(tick_s=60)
    await daemon.wait_ready()
    account = await new_account(pool)
    conversation = await new_conversation(pool, account)

    turn = await enqueue_demo(pool, account, conversation, "wake me", tokens=3)

    # The dispatcher claimed once at start and now idles for 60 s unless a NOTIFY wakes it.
    row = await wait_status(pool, turn.run_id, STARTED, timeout=10)
    assert row["worker_id"] == daemon.worker_id
    assert claim_latency(row) < timedelta(seconds=5), claim_latency(row)
    done = await wait_status(pool, turn.run_id, "completed", timeout=10)
    assert done["error"] is None


@dataclass(frozen=True)
class HubRole:
    name: str
    password: str


@pytest.fixture
async def hub_role(pg_admin_dsn: str) -> AsyncIterator[HubRole]:
    """A login role for the hub's DSN alone, so a test can keep the hub from reconnecting."""
    role = HubRole(f"agentd_hub_{uuid.uuid4().hex[:10]}", uuid.uuid4().hex)
    admin = await asyncpg.connect(pg_admin_dsn)
    try:
        # Identifiers and passwords cannot be bound parameters; both are generated here.
        await admin.execute(f"CREATE ROLE \"{role.name}\" LOGIN PASSWORD '{role.password}'")
        yield role
    finally:
        await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                            " WHERE usename = $1", role.name)
        await admin.execute(f'DROP ROLE IF EXISTS "{role.name}"')
        await admin.close()


async def test_hub_connection_killed_claims_by_poll_then_by_notify_again(
        hub_role, spawn_daemon, pool, dsn):
    daemon = spawn_daemon(tick_s=1, hub_dsn=with_user(dsn, hub_role.name, hub_role.password))
    await daemon.wait_ready()
    account = await new_account(pool)
    conversation = await new_conversation(pool, account)
    assert len(await pool.fetch(HUB_BACKENDS)) == 1, "one LISTEN connection per process"

    # Kill the hub's backend and keep it from logging back in: the hub is down for as long
    # as this test wants, not just for the instant a reconnect takes.
    await pool.execute(f'ALTER ROLE "{hub_role.name}" NOLOGIN')
    assert await pool.fetchval(TERMINATE_HUB) == 1
    await wait_hub(daemon, up=False, within=10)

    for n in range(2):
        turn = await enqueue_demo(pool, account, conversation, f"poll {n}", tokens=3)
        row = await wait_status(pool, turn.run_id, STARTED, timeout=6)
        assert row["worker_id"] == daemon.worker_id
        assert claim_latency(row) < timedelta(seconds=4), "not claimed within ~one tick"
        await wait_status(pool, turn.run_id, "completed", timeout=6)
    assert not await hub_state(daemon), "the hub came back early: these claims prove nothing"

    # Let it in again: the same process reconnects and re-LISTENs without a restart.
    await pool.execute(f'ALTER ROLE "{hub_role.name}" LOGIN')
    await wait_hub(daemon, up=True, within=15)
    assert len(await pool.fetch(HUB_BACKENDS)) == 1

    # Each turn is enqueued just after the dispatcher's last claim attempt (the reconnect's wake,
    # then the previous turn's), when the next poll is most of a tick away: only a NOTIFY
    # explains a claim within a fraction of the tick.
    for n in range(3):
        turn = await enqueue_demo(pool, account, conversation, f"notify {n}", tokens=3)
        row = await wait_status(pool, turn.run_id, STARTED, timeout=6)
        assert claim_latency(row) < timedelta(seconds=0.5), \
            f"claim took {claim_latency(row)}: the poll, not a NOTIFY"
        await wait_status(pool, turn.run_id, "completed", timeout=6)
    assert daemon.running
