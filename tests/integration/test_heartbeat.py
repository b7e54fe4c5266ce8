"""The process's one heartbeat (heartbeat.LeaseKeeper, queue.beat): every held lease renewed by
one statement on a connection of its own, each still fenced by its own token; a run that is no
longer ours comes back lost; a row locked elsewhere delays only itself; stops land at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import asyncpg
import pytest

from agentd.heartbeat import LeaseKeeper
from agentd.hub import Hub
from agentd.metrics import Metrics
from agentd.queue import (
    Claim,
    WorkerReport,
    beat,
    claim_runs,
    list_workers,
    reap_expired,
    renew_leases_waiting,
    stop_conversation,
)
from agentd.settings import Settings
from tests.integration.helpers import DEFAULT_TIMEOUT_S, connections, race, wait_lease_expired
from tests.integration.test_fencing import Staircase
from tests.support.daemon import poll_until
from tests.support.factories import enqueue, new_tenant, post_beside
from tests.support.journal import run_row

WORKER = "beat-host:4242:abcdef"
REPORT = WorkerReport(WORKER, "beat-host", 4242, listen="127.0.0.1:1", version="test",
                      runs_in_flight=3, max_runs=16, loop_lag_ms=12.5, pool_wait_ms=0.5)


async def claims(pool: asyncpg.Pool, n: int, lease_ttl_s: float = 30.0) -> list[Claim]:
    """`n` running turns of this worker, each in its own conversation."""
    for _ in range(n):
        tenant = await new_tenant(pool)
        await enqueue(pool, tenant.account_id, tenant.conversation_id)
    claimed: list[Claim] = []
    while len(claimed) < n:
        claimed += await claim_runs(pool, worker_id=WORKER, lease_ttl_s=lease_ttl_s,
                                    limit=n - len(claimed))
    return claimed


async def test_one_beat_renews_every_held_lease_and_registers_the_worker(
        pool: asyncpg.Pool) -> None:
    held = await claims(pool, 25)
    result = await beat(pool, REPORT, held, 60.0)
    assert (result.busy, result.lost) == ([], [])
    assert set(result.renewed) == {c.run_id for c in held}
    for claim in held:
        row = await run_row(pool, claim.run_id)
        assert row["lease_expires_at"] == result.renewed[claim.run_id].lease_expires_at \
            > claim.lease_expires_at
        assert row["last_heartbeat_at"] < claim.lease_expires_at
    [worker] = await list_workers(pool)
    assert (worker.id, worker.host, worker.pid, worker.runs_in_flight, worker.loop_lag_ms,
            worker.live) == (WORKER, "beat-host", 4242, 3, 12.5, True)


async def test_a_beat_never_revives_an_expired_lease_and_says_which_runs_are_lost(
        pool: asyncpg.Pool) -> None:
    live = await claims(pool, 3)
    expired = await claims(pool, 2, lease_ttl_s=0.05)
    for claim in expired:
        await wait_lease_expired(pool, claim.run_id)
    result = await beat(pool, REPORT, [*live, *expired], 60.0)
    assert set(result.renewed) == {c.run_id for c in live}
    assert sorted(result.lost) == sorted(c.run_id for c in expired)
    for claim in expired:
        row = await run_row(pool, claim.run_id)
        assert row["lease_expires_at"] == claim.lease_expires_at  # not revived
    # A token that is not the run's own (a superseded execution) renews nothing either.
    forged = dataclasses.replace(live[0], claim_token=expired[0].claim_token)
    assert (await beat(pool, REPORT, [forged], 60.0)).lost == [forged.run_id]


async def test_a_beat_racing_the_reaper_renews_or_loses_each_run_never_both(
        pool: asyncpg.Pool, dsn: str) -> None:
    aim = Staircase(0.01)
    seen = {"renewed": 0, "not renewed": 0}
    async with connections(dsn, 2) as (beater, reaper):
        for iteration in range(40):
            # Leases aimed at the race: each run expires around it, either side may win it.
            held = await claims(pool, 4, lease_ttl_s=aim.ttl_s)
            beaten, reaped = await race(lambda held=held: beat(beater, REPORT, held, 60.0),
                                        lambda: reap_expired(reaper, grace_s=0))
            assert not isinstance(beaten, BaseException), beaten
            assert not isinstance(reaped, BaseException), reaped
            for claim in held:
                row = await run_row(pool, claim.run_id)
                context = f"iteration {iteration}, run {claim.run_id}"
                if claim.run_id in beaten.renewed:
                    assert claim.run_id not in reaped, f"{context}: renewed and reaped"
                    assert row["status"] == "running", context
                    assert row["lease_expires_at"] == \
                        beaten.renewed[claim.run_id].lease_expires_at
                elif claim.run_id in reaped:
                    assert row["status"] == "failed", context
                    assert claim.run_id in beaten.lost or claim.run_id in beaten.busy, context
                else:
                    # The reaper came before the deadline, the beat after it: lost, not revived.
                    assert claim.run_id in beaten.lost, context
                    assert (row["status"], row["lease_expires_at"]) == \
                        ("running", claim.lease_expires_at), context
                seen["renewed" if claim.run_id in beaten.renewed else "not renewed"] += 1
            aim.worker_won(len(beaten.renewed) * 2 >= len(held))
    assert min(seen.values()) >= 4, seen  # the race landed on both sides of the deadline


async def test_a_row_locked_elsewhere_delays_only_its_own_renewal(pool: asyncpg.Pool,
                                                                  dsn: str) -> None:
    held = await claims(pool, 5)
    stuck = held[2]
    async with _conn(dsn) as blocker, blocker.transaction():
        # A transaction that holds the run's row (as a frozen stop sweep would).
        await blocker.execute("SELECT 1 FROM agent_run WHERE id = $1 FOR SHARE", stuck.run_id)
        result = await beat(pool, REPORT, held, 60.0)
        assert result.busy == [stuck.run_id] and result.lost == []
        assert set(result.renewed) == {c.run_id for c in held} - {stuck.run_id}
        async with _conn(dsn) as waiting:
            await waiting.execute("SET lock_timeout = '100ms'")
            with pytest.raises(asyncpg.LockNotAvailableError):
                await renew_leases_waiting(waiting, [stuck], 60.0)
    # Released: the retry renews it.
    assert set(await renew_leases_waiting(pool, [stuck], 60.0)) == {stuck.run_id}


@contextlib.asynccontextmanager
async def _conn(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(dsn)
    try:
        yield conn
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def keeper(dsn: str, settings: Settings) -> AsyncIterator[tuple[LeaseKeeper, Metrics]]:
    hub = Hub(dsn)
    await hub.start()
    metrics = Metrics()
    kept = LeaseKeeper(dsn, hub, settings, metrics, report=lambda: REPORT)
    kept.start()
    try:
        yield kept, metrics
    finally:
        await kept.close()
        await hub.close()


async def test_the_keeper_beats_for_all_its_runs_and_retires_its_worker_row(
        pool: asyncpg.Pool, dsn: str) -> None:
    settings = Settings(lease_ttl_s=1.5, heartbeat_s=0.3)
    held = await claims(pool, 10, lease_ttl_s=1.5)
    async with keeper(dsn, settings) as (kept, metrics):
        for claim in held:
            kept.hold(claim)

        async def beaten_thrice() -> bool:
            return kept.beats >= 3

        await poll_until(beaten_thrice, DEFAULT_TIMEOUT_S, interval=0.002, what="three beats")
        # Three beats kept ten leases, past their first deadline: one statement each time.
        await poll_until(lambda: _all_past(pool, held), DEFAULT_TIMEOUT_S, interval=0.002,
                         what="the first deadlines to pass")
        for claim in held:
            row = await run_row(pool, claim.run_id)
            assert row["status"] == "running" and row["lease_expires_at"] > claim.lease_expires_at
        assert metrics.registry.get_sample_value("agentd_heartbeats_total") == kept.beats
        assert [w.id for w in await list_workers(pool)] == [WORKER]
    assert await list_workers(pool) == []  # retired on close


async def _all_past(pool: asyncpg.Pool, held: list[Claim]) -> bool:
    now = await pool.fetchval("SELECT clock_timestamp()")
    return all(now > c.lease_expires_at for c in held)


async def test_the_keeper_tells_a_lost_run_and_a_stop_at_once(pool: asyncpg.Pool,
                                                              dsn: str) -> None:
    # A long heartbeat: what happens within it came from the hint or the lost verdict.
    settings = Settings(lease_ttl_s=90, heartbeat_s=30)
    [stopped] = await claims(pool, 1)
    [doomed] = await claims(pool, 1, lease_ttl_s=0.05)
    async with keeper(dsn, settings) as (kept, metrics):
        stopping = kept.hold(stopped)
        await wait_lease_expired(pool, doomed.run_id)
        losing = kept.hold(doomed)
        await stop_conversation(pool, account_id=stopped.account_id,
                                conversation_id=stopped.conversation_id)
        await asyncio.wait_for(stopping.cancel.wait(), 10)
        await asyncio.wait_for(losing.lost.wait(), 10)
        assert not stopping.lost.is_set()
        assert metrics.registry.get_sample_value("agentd_leases_lost_total") == 1
        assert len(kept) == 1  # the lost run is no longer beaten


async def test_a_stop_heard_before_its_run_is_held_lands_once_it_is_held(
        pool: asyncpg.Pool, dsn: str) -> None:
    """A turn claimed beside its post starts without reading its cancel flag (its transcript
    came with the claim), so a stop committed between the post's commit and the run being held
    is known from its hint alone: the keeper remembers the hint and beats as soon as the run is
    held, not a heartbeat later."""
    settings = Settings(lease_ttl_s=90, heartbeat_s=30)  # any beat in the test is the hint's
    tenant = await new_tenant(pool)
    async with keeper(dsn, settings) as (kept, _):
        _, [claim] = await post_beside(pool, tenant.account_id, tenant.conversation_id,
                                       "stopped before it is held", WORKER, 90)
        await stop_conversation(pool, account_id=tenant.account_id,
                                conversation_id=tenant.conversation_id)

        async def heard() -> bool:  # the keeper has taken the hint in (white box)
            return str(claim.run_id) in kept._unheld_stops

        await poll_until(heard, DEFAULT_TIMEOUT_S, interval=0.002, what="the stop hint")
        beats = kept.beats
        held = kept.hold(claim)
        await asyncio.wait_for(held.cancel.wait(), DEFAULT_TIMEOUT_S)
        assert kept.beats == beats + 1 and not held.lost.is_set()


async def test_a_renewal_changes_no_indexed_column_so_it_can_write_no_index_entry(
        pool: asyncpg.Pool) -> None:
    # No index of agent_run holds the lease columns, as a key, an expression or a predicate:
    # a renewal then qualifies as a heap-only update (sql/017), which writes no index entry.
    definitions = await pool.fetch(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = 'public' AND tablename = 'agent_run'")
    assert definitions
    for row in definitions:
        assert "lease_expires_at" not in row["indexdef"], row["indexdef"]
        assert "last_heartbeat_at" not in row["indexdef"], row["indexdef"]
    held = await claims(pool, 25)
    async with pool.acquire() as conn, conn.transaction():
        result = await beat(conn, REPORT, held, 60.0)
        assert set(result.renewed) == {c.run_id for c in held}
        heap_only = await conn.fetchval(
            "SELECT pg_stat_get_xact_tuples_hot_updated('agent_run'::regclass)")
    # Whether each one is depends on room on its row's page; the claims just moved these rows
    # to pages with room, so most are (with the old index on lease_expires_at: none).
    assert 0 < heap_only <= len(held)
