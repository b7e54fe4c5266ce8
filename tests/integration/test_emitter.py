"""The coalescing emitter: thousands of deltas become a few journal rows that add up exactly.

The first delta and every structural event write through at once; the clock flushes the rest
with no further call; a fenced-out emitter writes nothing more; a cancelled writer never leaves
seq out of step with the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator

import asyncpg
import pytest

from agentd.group_commit import Batcher
from agentd.journal import Emitter
from agentd.queue import (
    Claim,
    JournalBatch,
    Journaled,
    LeaseLost,
    append_events_many,
    claim_runs,
    finish_run,
    heartbeat,
    reap_expired,
)
from agentd.vocabulary import Channel, EventType, RunStatus
from tests.integration.helpers import DEFAULT_TIMEOUT_S, count_rows, wait_lease_expired
from tests.support.daemon import poll_until
from tests.support.factories import enqueue, new_tenant
from tests.support.journal import assert_journal_sound, read_journal

LONG_S = 60.0
NEVER_S = 3600.0  # a flush interval the test never reaches: the clock cannot be what wrote


async def start_run(pool: asyncpg.Pool) -> Claim:
    tenant = await new_tenant(pool)
    await enqueue(pool, tenant.account_id, tenant.conversation_id, "go")
    [claim] = await claim_runs(pool, worker_id="worker", lease_ttl_s=LONG_S)
    return claim


async def deltas_of(pool: asyncpg.Pool, claim: Claim) -> list[str]:
    return [e["payload"]["delta"] for e in await read_journal(pool, claim.run_id)
            if e["type"] == EventType.CONTENT_DELTA]


async def test_burst_of_deltas_becomes_few_rows_whose_concatenation_is_the_input(
        pool: asyncpg.Pool) -> None:
    claim = await start_run(pool)
    emitter = Emitter(pool, claim)  # the product's own flush interval: coalescing is the point
    pieces = [f"tok{i} " if i % 7 else f"ü\"\\{i}\n✓ " for i in range(5_000)]
    for piece in pieces:
        await emitter.delta(piece)
    await emitter.close()

    rows = await assert_journal_sound(pool, claim.run_id)
    deltas = [r for r in rows if r["type"] == EventType.CONTENT_DELTA]
    assert "".join(r["payload"]["delta"] for r in deltas) == "".join(pieces)
    assert 2 <= len(deltas) <= 10, len(deltas)
    assert emitter.rows_written == len(deltas) and emitter.deltas_seen == len(pieces)
    assert emitter.next_seq == rows[-1]["seq"] + 1


async def test_first_delta_is_written_before_the_clock_fires(pool: asyncpg.Pool) -> None:
    claim = await start_run(pool)
    emitter = Emitter(pool, claim, flush_interval_s=NEVER_S)
    await emitter.delta("Hel")
    assert await deltas_of(pool, claim) == ["Hel"]
    await emitter.delta("lo")
    await emitter.delta(", world")
    assert await deltas_of(pool, claim) == ["Hel"]  # the rest waits for the clock
    await emitter.close()
    assert await deltas_of(pool, claim) == ["Hel", "lo, world"]
    await assert_journal_sound(pool, claim.run_id)


async def test_structural_event_writes_through_with_pending_deltas_in_order(
        pool: asyncpg.Pool) -> None:
    claim = await start_run(pool)
    emitter = Emitter(pool, claim, flush_interval_s=NEVER_S)
    await emitter.delta("a")
    await emitter.delta("b")
    await emitter.delta("c")
    await emitter.event(EventType.TOOL_CALL, {"call_id": "1", "name": "clock"})
    await emitter.event(EventType.TOOL_RESULT, {"call_id": "1", "result": "noon"})
    await emitter.delta("d")

    rows = await assert_journal_sound(pool, claim.run_id)
    # rows[2] is run_started, journaled by the claim itself.
    assert [(r["seq"], r["type"], r["payload"]) for r in rows[3:]] == [
        (4, EventType.CONTENT_DELTA, {"delta": "a"}),
        (5, EventType.CONTENT_DELTA, {"delta": "bc"}),
        (6, EventType.TOOL_CALL, {"call_id": "1", "name": "clock"}),
        (7, EventType.TOOL_RESULT, {"call_id": "1", "result": "noon"}),
    ]
    # The pending deltas rode in the same batch (one transaction) as the event they preceded.
    assert rows[4]["xid"] == rows[5]["xid"] != rows[6]["xid"]
    await emitter.close()
    assert await deltas_of(pool, claim) == ["a", "bc", "d"]


async def test_pending_deltas_are_flushed_by_the_clock_without_further_calls(
        pool: asyncpg.Pool) -> None:
    claim = await start_run(pool)
    emitter = Emitter(pool, claim, flush_interval_s=0.02)
    await emitter.delta("first ")
    await emitter.delta("second ")
    await emitter.delta("third")

    async def flushed() -> list[str] | None:
        deltas = await deltas_of(pool, claim)
        return deltas if len(deltas) > 1 else None

    assert await poll_until(flushed, DEFAULT_TIMEOUT_S, interval=0.002,
                            what="the clock's flush") == ["first ", "second third"]
    await emitter.close()
    assert await deltas_of(pool, claim) == ["first ", "second third"]
    await assert_journal_sound(pool, claim.run_id)


async def reaped_under(pool: asyncpg.Pool, emitter: Emitter, claim: Claim) -> None:
    """The worker stalls; its lease lapses and the reaper ends the run."""
    await heartbeat(pool, claim, 0.05)
    await wait_lease_expired(pool, claim.run_id)
    assert await reap_expired(pool) == [claim.run_id]


async def test_emitter_after_a_reap_raises_lease_lost_and_writes_nothing(
        pool: asyncpg.Pool) -> None:
    claim = await start_run(pool)
    emitter = Emitter(pool, claim, flush_interval_s=NEVER_S)
    await emitter.delta("before ")
    await emitter.delta("pending")
    await reaped_under(pool, emitter, claim)
    counts = await count_rows(pool, claim.run_id)

    with pytest.raises(LeaseLost):
        await emitter.event(EventType.TOOL_CALL, {"call_id": "1"})
    with pytest.raises(LeaseLost):
        await emitter.delta("more")
    with pytest.raises(LeaseLost):
        await emitter.event(EventType.TOOL_RESULT, {"call_id": "1"})
    with pytest.raises(LeaseLost):
        await emitter.close()
    assert emitter.lost is not None
    assert await count_rows(pool, claim.run_id) == counts
    rows = await assert_journal_sound(pool, claim.run_id)
    assert rows[-1]["payload"]["status"] == RunStatus.FAILED


async def test_emitter_whose_clock_flush_is_fenced_raises_lease_lost_on_the_next_call(
        pool: asyncpg.Pool) -> None:
    claim = await start_run(pool)
    emitter = Emitter(pool, claim, flush_interval_s=0.02)
    await emitter.delta("before")
    await reaped_under(pool, emitter, claim)
    counts = await count_rows(pool, claim.run_id)

    await emitter.delta(" after the reap")  # buffered: only the clock will try to write it

    async def lost() -> bool:
        return emitter.lost is not None

    await poll_until(lost, DEFAULT_TIMEOUT_S, interval=0.002,
                     what="the clock's flush to be fenced out")
    with pytest.raises(LeaseLost):
        await emitter.delta("more")
    with pytest.raises(LeaseLost):
        await emitter.close()
    assert await count_rows(pool, claim.run_id) == counts


@contextlib.asynccontextmanager
async def run_row_locked(pool: asyncpg.Pool, claim: Claim) -> AsyncIterator[None]:
    """Hold the run row so every fenced write queues behind us: a write provably in flight."""
    async with pool.acquire() as blocker, blocker.transaction():
        await blocker.execute("SELECT 1 FROM agent_run WHERE id = $1 FOR UPDATE", claim.run_id)
        yield


async def yield_to_loop(times: int = 20) -> None:
    """Let ready tasks run their I/O-free steps; no wall-clock time is waited for."""
    for _ in range(times):
        await asyncio.sleep(0)


async def wait_for_blocked_writes(pool: asyncpg.Pool, n: int) -> None:
    async def blocked() -> bool:
        return await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE '%run_event%'") >= n

    await poll_until(blocked, DEFAULT_TIMEOUT_S, interval=0.002,
                     what=f"{n} journal write(s) waiting on the run row")


async def test_cancelling_the_emitting_task_mid_write_keeps_seq_contiguous(
        pool: asyncpg.Pool) -> None:
    claim = await start_run(pool)
    emitter = Emitter(pool, claim, flush_interval_s=NEVER_S)
    await emitter.event(EventType.RUN_STARTED, {"fence": claim.fence})
    async with run_row_locked(pool, claim):
        calling = asyncio.create_task(emitter.event(EventType.TOOL_CALL, {"call_id": "1"}))
        await wait_for_blocked_writes(pool, 1)  # its batch is provably in flight
        answering = asyncio.create_task(emitter.event(EventType.TOOL_RESULT, {"call_id": "1"}))
        await yield_to_loop()  # queued behind the batch in flight
        # A stop arrives: the executor cancels the generating task mid-write...
        calling.cancel()
        answering.cancel()
        await yield_to_loop()
        # ...then journals the stop while those batches may still be landing.
        stopping = asyncio.create_task(
            emitter.event(EventType.CANCEL_REQUESTED, {"partial": False}))
        await yield_to_loop()  # it takes its seq, or its turn, while the batch is in flight
    for cancelled in (calling, answering):
        with pytest.raises(asyncio.CancelledError):
            await cancelled
    await stopping
    await emitter.close()
    await finish_run(pool, claim, RunStatus.CANCELLED, seq=emitter.next_seq)

    rows = await assert_journal_sound(pool, claim.run_id)
    # A batch taken for writing lands whatever happens to its caller, in call order.
    assert [r["type"] for r in rows[3:]] == [
        EventType.RUN_STARTED, EventType.TOOL_CALL, EventType.TOOL_RESULT,
        EventType.CANCEL_REQUESTED, EventType.COMPLETE]
    assert emitter.lost is None


async def test_close_while_the_clock_is_flushing_keeps_seq_contiguous(
        pool: asyncpg.Pool) -> None:
    claim = await start_run(pool)
    emitter = Emitter(pool, claim, flush_interval_s=0.02)
    await emitter.delta("first ")
    async with run_row_locked(pool, claim):
        await emitter.delta("second")
        await wait_for_blocked_writes(pool, 1)  # the clock's flush is in flight

        async def close() -> int:
            await emitter.close()
            return emitter.next_seq  # what the executor reads for the terminal write

        closing = asyncio.create_task(close())
        await yield_to_loop()  # close may not return before the batch in flight has landed
    await finish_run(pool, claim, RunStatus.COMPLETED, seq=await closing,
                     content="first second")

    rows = await assert_journal_sound(pool, claim.run_id)
    assert [r["payload"].get("delta") for r in rows[3:5]] == ["first ", "second"]
    assert rows[-1]["type"] == EventType.COMPLETE and len(rows) == 6
    assert emitter.lost is None


async def test_a_cancelled_writer_whose_batch_is_then_fenced_out_leaves_no_lost_exception(
        pool: asyncpg.Pool) -> None:
    """The conversation is deleted while a batch waits on the run row and its caller is
    cancelled (a stop, a lost heartbeat): the batch fails as LeaseLost, recorded for the owner,
    and asyncio is never left with an exception nobody retrieved (logged as a crash)."""
    claim = await start_run(pool)
    emitter = Emitter(pool, claim, flush_interval_s=NEVER_S)
    await emitter.event(EventType.RUN_STARTED, {"fence": claim.fence})
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        async with pool.acquire() as deleter, deleter.transaction():
            await deleter.execute("SELECT 1 FROM agent_run WHERE id = $1 FOR UPDATE",
                                  claim.run_id)
            calling = asyncio.create_task(emitter.event(EventType.TOOL_CALL, {"call_id": "1"}))
            await wait_for_blocked_writes(pool, 1)  # its batch is provably in flight
            calling.cancel()
            await yield_to_loop()
            await deleter.execute("DELETE FROM conversation WHERE id = $1",
                                  claim.conversation_id)
        with pytest.raises(asyncio.CancelledError):
            await calling
        del calling

        async def recorded() -> bool:
            return emitter.lost is not None

        await poll_until(recorded, DEFAULT_TIMEOUT_S, interval=0.002,
                         what="the fenced-out batch to be recorded")
        assert isinstance(emitter.lost, LeaseLost)
        gc.collect()
        await yield_to_loop()
    finally:
        loop.set_exception_handler(previous)
    assert reported == []


async def test_a_batch_found_landed_after_its_lost_answer_is_announced(
        pool: asyncpg.Pool) -> None:
    """The append commits, its answer is lost, the retry meets its own rows (SeqConflict) and
    finds the batch landed: the rows' wake and their note to this process's readers never went
    out, so every tail and feed learned of them only at its next poll."""
    claim = await start_run(pool)
    calls = 0

    async def committed_then_lost(batches: list[JournalBatch]) -> list[Journaled | Exception]:
        nonlocal calls
        calls += 1
        written = await append_events_many(pool, batches)
        if calls == 1:
            raise asyncpg.exceptions.ConnectionDoesNotExistError(
                "connection was closed in the middle of operation")
        return written

    hints: list[tuple[Channel, str]] = []
    told: list[object] = []
    emitter = Emitter(pool, claim, flush_interval_s=NEVER_S,
                      hint=lambda channel, payload: hints.append((channel, payload)),
                      appends=Batcher(pool, committed_then_lost),
                      journaled=lambda run_id, rows: told.append(run_id))
    await emitter.event(EventType.RUN_STARTED, {})
    await emitter.flush()
    assert calls == 2, calls
    assert [e["type"] for e in await read_journal(pool, claim.run_id)][-1] == EventType.RUN_STARTED
    assert (Channel.RUN_EVENT, str(claim.run_id)) in hints, "the rows were never announced"
    assert told == [claim.run_id]
