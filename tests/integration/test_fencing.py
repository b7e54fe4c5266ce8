"""Fencing: a worker whose claim is no longer live writes nothing, and every run ends once.

Zombie writes are refused by the database (zero rows, LeaseLost); terminal states are sticky;
heartbeat, append and finish racing the reaper at the deadline always leave exactly one story.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid

import asyncpg
import pytest

from agentd.queue import (
    Claim,
    LeaseLost,
    NewEvent,
    SeqConflict,
    append_events,
    claim_runs,
    finish_run,
    heartbeat,
    insert_message,
    reap_expired,
    stop_conversation,
)
from agentd.vocabulary import EventType, MessageRole, RunStatus
from tests.integration.helpers import (
    DEFAULT_TIMEOUT_S,
    connections,
    count_rows,
    race,
    raise_unexpected,
    wait_lease_expired,
)
from tests.support.daemon import poll_until
from tests.support.factories import Tenant, enqueue, new_conversation, new_tenant
from tests.support.journal import assert_journal_sound, read_journal, run_row

LONG_S = 60.0
TINY_S = 0.05
RACE_ITERATIONS = 200


async def start_run(db: asyncpg.Pool | asyncpg.Connection, tenant: Tenant,
                    lease_ttl_s: float = LONG_S) -> Claim:
    conv = await new_conversation(db, tenant.account_id)
    await enqueue(db, tenant.account_id, conv, "work")
    [claim] = await claim_runs(db, worker_id="worker", lease_ttl_s=lease_ttl_s)
    return claim


async def zombie_writes(db: asyncpg.Pool, claim: Claim) -> list[str]:
    """Every kind of worker write with `claim`; the names of those that were NOT refused."""
    accepted = []
    attempts = {
        "append": lambda: append_events(db, claim, [
            NewEvent(seq, EventType.CONTENT_DELTA, {"delta": "zombie"}) for seq in (5, 6)]),
        "message": lambda: insert_message(db, claim, role=MessageRole.ASSISTANT,
                                          content="zombie"),
        "finish": lambda: finish_run(db, claim, RunStatus.COMPLETED, seq=5, content="zombie"),
        "finish-max+1": lambda: finish_run(db, claim, RunStatus.COMPLETED, seq=None),
        "heartbeat": lambda: heartbeat(db, claim, LONG_S),
    }
    for name, attempt in attempts.items():
        try:
            await attempt()
        except LeaseLost:
            continue
        accepted.append(name)
    return accepted


@pytest.mark.parametrize("fenced_by", ["deadline", "reap", "forged-token", "finished"])
async def test_zombie_writer_is_refused_and_writes_zero_rows(
        pool: asyncpg.Pool, fenced_by: str) -> None:
    tenant = await new_tenant(pool)
    claim = await start_run(pool, tenant)
    await append_events(pool, claim, [NewEvent(claim.last_seq + 1, EventType.CONTENT_DELTA,
                                               {"delta": "a"})])
    zombie = claim
    if fenced_by in ("deadline", "reap"):
        await heartbeat(pool, claim, TINY_S)  # the worker stalls after this beat
        await wait_lease_expired(pool, claim.run_id)
        if fenced_by == "reap":
            assert await reap_expired(pool) == [claim.run_id]
    elif fenced_by == "forged-token":
        zombie = dataclasses.replace(claim, claim_token=uuid.uuid4())
    else:
        await finish_run(pool, claim, RunStatus.COMPLETED, seq=5, content="answer")

    counts = await count_rows(pool, claim.run_id)
    run = await run_row(pool, claim.run_id)
    assert await zombie_writes(pool, zombie) == []
    assert await count_rows(pool, claim.run_id) == counts
    assert await run_row(pool, claim.run_id) == run
    await assert_journal_sound(pool, claim.run_id)


@pytest.mark.parametrize("status", [RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED])
async def test_terminal_states_are_sticky(pool: asyncpg.Pool, status: RunStatus) -> None:
    tenant = await new_tenant(pool)
    claim = await start_run(pool, tenant)
    await finish_run(pool, claim, status, seq=claim.last_seq + 1, content="answer")
    # A finished run's deadline passes like any other: still nothing may end it again.
    await pool.execute("UPDATE agent_run SET lease_expires_at = clock_timestamp() - interval '1s'"
                       " WHERE id = $1", claim.run_id)
    run = await run_row(pool, claim.run_id)
    counts = await count_rows(pool, claim.run_id)

    for again in RunStatus:
        if again.terminal:
            with pytest.raises(LeaseLost):
                await finish_run(pool, claim, again, seq=None)
    assert await reap_expired(pool) == []
    stopped = await stop_conversation(pool, account_id=tenant.account_id,
                                      conversation_id=claim.conversation_id)
    assert (stopped.cancelled, stopped.flagged) == ([], [])
    assert await zombie_writes(pool, claim) == []

    assert await run_row(pool, claim.run_id) == run
    assert run["status"] == status
    assert await count_rows(pool, claim.run_id) == counts
    events = await assert_journal_sound(pool, claim.run_id)
    assert events[-1]["payload"]["status"] == status


class Staircase:
    """Aims a race at the deadline: shortens the lease after the worker wins, lengthens it after
    the reaper wins, so the race keeps landing on the boundary whatever the machine's speed."""

    def __init__(self, start_s: float = 0.001) -> None:
        self.ttl_s = start_s

    def worker_won(self, won: bool) -> None:
        self.ttl_s = min(max(self.ttl_s * (0.8 if won else 1.25), 0.0001), 0.5)


async def reap_until_decided(conn: asyncpg.Connection, claim: Claim) -> bool:
    """The reaper sweeping across the deadline: True once it finalized the run, False once the
    run is no longer reapable by anyone (renewed or ended by its worker)."""
    give_up = time.monotonic() + 10
    while time.monotonic() < give_up:
        if claim.run_id in await reap_expired(conn):
            return True
        row = await conn.fetchrow(
            "SELECT status, lease_expires_at FROM agent_run WHERE id = $1", claim.run_id)
        if row["status"] != RunStatus.RUNNING or row["lease_expires_at"] != claim.lease_expires_at:
            return False
    raise AssertionError("the reaper never decided")


async def test_heartbeat_racing_reap_at_the_deadline_has_exactly_one_winner(dsn: str) -> None:
    aim = Staircase()
    outcomes = {"heartbeat": 0, "reaper": 0}
    async with connections(dsn, 2) as (worker, reaper):
        tenant = await new_tenant(worker)
        for iteration in range(RACE_ITERATIONS):
            claim = await start_run(worker, tenant, aim.ttl_s)
            beat, reaped = await race(lambda claim=claim: heartbeat(worker, claim, LONG_S),
                                      lambda claim=claim: reap_until_decided(reaper, claim))
            context = f"iteration {iteration}, ttl {aim.ttl_s}"
            raise_unexpected([beat, reaped], LeaseLost, context=context)
            assert not isinstance(reaped, BaseException), context
            run = await run_row(worker, claim.run_id)
            events = await read_journal(worker, claim.run_id)
            if isinstance(beat, LeaseLost):
                assert reaped, f"{context}: neither side won"
                assert run["status"] == RunStatus.FAILED
                assert run["lease_expires_at"] == claim.lease_expires_at
                assert run["finished_at"] >= claim.lease_expires_at
                assert [e["type"] for e in events][-1] == EventType.COMPLETE
            else:
                assert not reaped, f"{context}: both the heartbeat and the reap won"
                assert run["status"] == RunStatus.RUNNING
                assert run["lease_expires_at"] == beat.lease_expires_at > claim.lease_expires_at
                # A heartbeat only renews a lease it still held when it landed.
                assert run["last_heartbeat_at"] < claim.lease_expires_at, context
                assert EventType.COMPLETE not in [e["type"] for e in events]
                await finish_run(worker, claim, RunStatus.COMPLETED, seq=claim.last_seq + 1)
            await assert_journal_sound(worker, claim.run_id)
            winner = "reaper" if reaped else "heartbeat"
            outcomes[winner] += 1
            aim.worker_won(winner == "heartbeat")
    # The race was real: both sides won it many times.
    assert min(outcomes.values()) >= RACE_ITERATIONS // 10, outcomes


async def test_finish_racing_reap_at_the_deadline_ends_the_run_once(dsn: str) -> None:
    aim = Staircase()
    outcomes = {"worker": 0, "reaper": 0}
    async with connections(dsn, 2) as (worker, reaper):
        tenant = await new_tenant(worker)
        for iteration in range(RACE_ITERATIONS):
            claim = await start_run(worker, tenant, aim.ttl_s)
            finished, reaped = await race(
                lambda claim=claim: finish_run(worker, claim, RunStatus.COMPLETED,
                                               seq=claim.last_seq + 1,
                                               content="answer"),
                lambda claim=claim: reap_until_decided(reaper, claim))
            context = f"iteration {iteration}, ttl {aim.ttl_s}"
            raise_unexpected([finished, reaped], LeaseLost, context=context)
            run = await run_row(worker, claim.run_id)
            events = await assert_journal_sound(worker, claim.run_id)
            assert [e["seq"] for e in events] == [1, 2, 3, 4], context
            answers = await worker.fetchval(
                "SELECT count(*) FROM message WHERE run_id = $1 AND role = 'assistant'",
                claim.run_id)
            if isinstance(finished, LeaseLost):
                assert reaped is True, f"{context}: neither side ended the run"
                assert run["status"] == RunStatus.FAILED and answers == 0
                assert events[-1]["payload"]["status"] == RunStatus.FAILED
            else:
                assert reaped is False, f"{context}: both ended the run"
                assert run["status"] == RunStatus.COMPLETED and answers == 1
                assert run["finished_at"] < claim.lease_expires_at, context
                assert events[-1]["payload"]["status"] == RunStatus.COMPLETED
            outcomes["reaper" if reaped else "worker"] += 1
            aim.worker_won(not reaped)
    assert min(outcomes.values()) >= RACE_ITERATIONS // 10, outcomes


async def test_append_racing_reap_never_duplicates_or_skips_a_seq(dsn: str) -> None:
    rng = random.Random()
    async with connections(dsn, 2) as (worker, reaper):
        tenant = await new_tenant(worker)
        for iteration in range(100):
            claim = await start_run(worker, tenant, rng.uniform(0.001, 0.01))
            written: list[int] = []

            async def append_until_fenced(claim: Claim = claim,
                                          written: list[int] = written) -> LeaseLost:
                seq = claim.last_seq + 1
                while True:
                    # Now and then a long batch, so the deadline often falls inside an append.
                    size = rng.choice((1, 2, 3, 300))
                    batch = [NewEvent(seq + i, EventType.CONTENT_DELTA, {"delta": f"{seq + i} "})
                             for i in range(size)]
                    try:
                        await append_events(worker, claim, batch)
                    except LeaseLost as lost:
                        return lost
                    written.extend(e.seq for e in batch)
                    seq += len(batch)

            fenced, reaped = await race(append_until_fenced,
                                        lambda claim=claim: reap_until_decided(reaper, claim))
            context = f"iteration {iteration}"
            assert isinstance(fenced, LeaseLost), f"{context}: {fenced!r}"
            assert reaped is True, f"{context}: {reaped!r}"
            events = await assert_journal_sound(worker, claim.run_id)
            # Every acknowledged append is there, then exactly one ending right after it.
            assert [e["seq"] for e in events] == [1, 2, 3, *written, len(written) + 4], context
            assert events[-1]["type"] == EventType.COMPLETE
            assert events[-1]["payload"]["status"] == RunStatus.FAILED


async def test_backstop_finish_racing_an_append_in_flight_lands_after_it(
        pool: asyncpg.Pool) -> None:
    """The dispatcher's backstop (seq=None, max+1) while the worker's last batch is in flight:
    it may be told SeqConflict and retry, but the ending lands once, right after the batch."""
    tenant = await new_tenant(pool)
    claim = await start_run(pool, tenant)
    batch = [NewEvent(seq, EventType.CONTENT_DELTA, {"delta": "x"}) for seq in (4, 5, 6)]
    async with pool.acquire() as blocker:
        async with blocker.transaction():
            await blocker.execute("SELECT 1 FROM agent_run WHERE id = $1 FOR UPDATE",
                                  claim.run_id)
            appending = asyncio.create_task(append_events(pool, claim, batch))
            await wait_for_waiters(pool, 1)
            finishing = asyncio.create_task(
                finish_run(pool, claim, RunStatus.FAILED, seq=None, error="turn crashed"))
            await wait_for_waiters(pool, 2)  # both queued on the run row, append first
        await appending
        for _attempt in range(3):
            try:
                await finishing
                break
            except SeqConflict:
                finishing = asyncio.create_task(
                    finish_run(pool, claim, RunStatus.FAILED, seq=None, error="turn crashed"))
        else:
            raise AssertionError("the backstop never landed")
    events = await assert_journal_sound(pool, claim.run_id)
    assert [e["seq"] for e in events] == [1, 2, 3, 4, 5, 6, 7]
    assert events[-1]["payload"]["status"] == RunStatus.FAILED


async def wait_for_waiters(pool: asyncpg.Pool, n: int) -> None:
    """Until `n` sessions of this database wait on a lock."""

    async def waiting() -> bool:
        return await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'") >= n

    await poll_until(waiting, DEFAULT_TIMEOUT_S, interval=0.002,
                     what=f"{n} session(s) waiting on a lock")
