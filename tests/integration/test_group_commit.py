"""Group commit: journal writes of many runs share a transaction, each still behind its own
fence; a refused one rolls back alone, and the others land whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Sequence
from typing import cast

import asyncpg
import pytest

from agentd.group_commit import Batcher
from agentd.journal import Emitter
from agentd.queue import (
    Claim,
    Finish,
    JournalBatch,
    Journaled,
    LeaseLost,
    NewEvent,
    SeqConflict,
    append_events_batched,
    append_events_many,
    claim_runs,
    finish_run_journaled,
    finish_runs,
)
from agentd.vocabulary import EventType, RunStatus
from tests.support.daemon import poll_until
from tests.support.factories import enqueue, new_tenant
from tests.support.journal import assert_journal_sound, read_journal

RUNS = 12
LONG_S = 60.0


async def claimed_runs(pool: asyncpg.Pool, count: int) -> list[Claim]:
    for _ in range(count):
        tenant = await new_tenant(pool)
        await enqueue(pool, tenant.account_id, tenant.conversation_id, "go")
    claims = await claim_runs(pool, worker_id="worker", lease_ttl_s=LONG_S, limit=count)
    assert len(claims) == count
    return claims


def delta(claim: Claim, text: str, offset: int = 1) -> list[NewEvent]:
    return [NewEvent(claim.last_seq + offset, EventType.CONTENT_DELTA, {"delta": text})]


async def test_writes_arriving_during_a_commit_share_the_next_and_a_fenced_one_fails_alone(
        pool: asyncpg.Pool) -> None:
    claims = await claimed_runs(pool, RUNS)
    writing, gate = asyncio.Event(), asyncio.Event()

    async def write(batches: Sequence[JournalBatch]) -> list[Journaled | Exception]:
        writing.set()
        await gate.wait()  # the commit under way, until every other write has arrived
        return await append_events_many(pool, batches)

    group = Batcher(pool, write, max_in_flight=1)
    submitted = 0
    submit = group.submit

    async def counted(item: JournalBatch) -> Journaled:
        nonlocal submitted
        submitted += 1
        return await submit(item)

    group.submit = counted  # type: ignore[method-assign]
    # One execution that no longer owns its run (another token), and one whose seq is taken.
    stale = dataclasses.replace(claims[1], claim_token=uuid.uuid4())
    taken = claims[2]
    gate.set()
    await append_events_batched(group, taken, delta(taken, "first"))
    gate.clear()
    writing.clear()
    hinted: list[str] = []

    def write_text(i: int, claim: Claim) -> asyncio.Future[None]:
        return asyncio.ensure_future(append_events_batched(
            group, claim, delta(claim, f"text {i}"), hint=lambda _ch, p: hinted.append(p)))

    writes = [write_text(0, claims[0])]
    await writing.wait()  # the first of them is being written alone...
    writes += [write_text(i, c) for i, c in enumerate([stale, *claims[2:]], start=1)]

    async def all_arrived() -> bool:
        return submitted == 1 + RUNS

    await poll_until(all_arrived, 10.0)  # ...while the others arrive
    gate.set()
    results = await asyncio.gather(*writes, return_exceptions=True)

    # "first" alone; then the first of the twelve, alone; then the eleven that arrived during
    # its commit, together.
    assert group.items == RUNS + 1 and group.batches == 3
    assert isinstance(results[1], LeaseLost) and not isinstance(results[1], SeqConflict)
    assert isinstance(results[2], SeqConflict)
    for i, claim in enumerate(claims):
        rows = await read_journal(pool, claim.run_id)
        deltas = [r["payload"]["delta"] for r in rows if r["type"] == EventType.CONTENT_DELTA]
        if i == 1:
            assert deltas == [] and results[i] is not None
        elif i == 2:
            assert deltas == ["first"]
        else:
            assert results[i] is None and deltas == [f"text {i}"]
    # Hints only for what landed, after the commit.
    assert sorted(hinted) == sorted(str(c.run_id) for i, c in enumerate(claims) if i not in (1, 2))


async def test_turns_ending_together_finish_in_shared_commits_each_whole(
        pool: asyncpg.Pool) -> None:
    claims = await claimed_runs(pool, RUNS)
    group = Batcher(pool, lambda items: finish_runs(pool, items))
    appends = Batcher(pool, lambda batches: append_events_many(pool, batches))
    emitters = [Emitter(pool, c, flush_interval_s=3600, appends=appends) for c in claims]
    for i, emitter in enumerate(emitters):
        await emitter.delta(f"first {i} ")  # written through at once (in a group of its own)
        await emitter.delta(f"last {i}")  # pending: rides in the terminal write
    lasts = [await e.hand_over() for e in emitters]
    before = group.batches
    await asyncio.gather(*(finish_run_journaled(
        pool, c, RunStatus.COMPLETED, last=last, seq=e.next_seq,
        content=f"first {i} last {i}", finishes=group)
        for i, (c, e, last) in enumerate(zip(claims, emitters, lasts, strict=True))))
    # Ended in one turn of the event loop, all twelve go in ONE statement, though the batcher
    # was idle with four writers free (cutting a batch as the first arrived gave four).
    assert group.batches - before == 1
    for i, claim in enumerate(claims):
        rows = await assert_journal_sound(pool, claim.run_id)
        text = "".join(r["payload"]["delta"] for r in rows
                       if r["type"] == EventType.CONTENT_DELTA)
        assert text == f"first {i} last {i}"
        assert rows[-1]["type"] == EventType.COMPLETE
        status = await pool.fetchval("SELECT status FROM agent_run WHERE id = $1",
                                     claim.run_id)
        assert status == RunStatus.COMPLETED


async def test_a_failed_commit_fails_every_write_of_its_group(pool: asyncpg.Pool,
                                                               dsn: str) -> None:
    [claim] = await claimed_runs(pool, 1)
    from agentd import db as dbmod

    own = await dbmod.create_pool(dsn, min_size=1, max_size=1)
    group = Batcher(own, lambda items: finish_runs(own, items))
    appends = Batcher(own, lambda batches: append_events_many(own, batches))
    await own.close()
    with pytest.raises(asyncpg.InterfaceError):
        await append_events_batched(appends, claim, delta(claim, "never"))
    with pytest.raises(asyncpg.InterfaceError):
        await finish_run_journaled(own, claim, RunStatus.COMPLETED, last=[], seq=claim.last_seq + 1,
                                   finishes=group)
    assert [r for r in await read_journal(pool, claim.run_id)
            if r["type"] == EventType.CONTENT_DELTA] == []


async def test_a_shared_terminal_write_ends_each_run_behind_its_own_fence(
        pool: asyncpg.Pool) -> None:
    """One statement ends many runs: a run this execution no longer owns is refused alone (its
    last batch unwritten too), a failed run keeps its journal's text plus the deltas written
    with its ending, the others end whole."""
    claims = await claimed_runs(pool, 4)
    await append_events_many(pool, [(claims[2], delta(claims[2], "seen "))])
    stale = dataclasses.replace(claims[1], claim_token=uuid.uuid4())
    outcomes = await finish_runs(pool, [
        Finish(claims[0], RunStatus.COMPLETED, claims[0].last_seq + 2,
               last=delta(claims[0], "answer"), content="answer"),
        Finish(stale, RunStatus.COMPLETED, stale.last_seq + 2, last=delta(stale, "never"),
               content="never"),
        Finish(claims[2], RunStatus.FAILED, claims[2].last_seq + 3,
               last=delta(claims[2], "and more", offset=2), error="boom",
               error_code="provider_error"),
        Finish(claims[3], RunStatus.CANCELLED, None),
    ])
    assert isinstance(outcomes[1], LeaseLost) and not isinstance(outcomes[1], SeqConflict)
    assert outcomes[3] is None  # nothing said, no answer
    for i in (0, 2):
        assert isinstance(outcomes[i], uuid.UUID)
    answers = {row["run_id"]: (row["content"], row["status"]) for row in await pool.fetch(
        "SELECT run_id, content, status FROM message WHERE role = 'assistant'"
        " AND run_id = ANY($1)", [c.run_id for c in claims])}
    assert answers == {claims[0].run_id: ("answer", "complete"),
                       claims[2].run_id: ("seen and more", "failed")}
    statuses = dict(await pool.fetch("SELECT id, status FROM agent_run WHERE id = ANY($1)",
                                     [c.run_id for c in claims]))
    assert statuses == {claims[0].run_id: "completed", claims[1].run_id: "running",
                        claims[2].run_id: "failed", claims[3].run_id: "cancelled"}
    # Untouched: its last batch was not written either.
    assert not [r for r in await read_journal(pool, claims[1].run_id)
                if r["type"] in (EventType.CONTENT_DELTA, EventType.COMPLETE)]
    for i in (0, 2, 3):
        await assert_journal_sound(pool, claims[i].run_id)
    leases = await pool.fetchval("SELECT count(*) FROM conversation_lease WHERE run_id = ANY($1)",
                                 [claims[i].run_id for i in (0, 2, 3)])
    assert leases == 0


async def test_a_taken_seq_in_a_shared_terminal_write_is_told_apart(pool: asyncpg.Pool) -> None:
    """A seq someone else wrote fails the shared statement; each run alone then tells whose."""
    claims = await claimed_runs(pool, 3)
    taken = claims[1]
    await append_events_many(pool, [(taken, delta(taken, "first"))])
    outcomes = await finish_runs(pool, [
        Finish(c, RunStatus.COMPLETED, c.last_seq + 1, content="done") for c in claims])
    assert isinstance(outcomes[1], SeqConflict)
    assert all(isinstance(outcomes[i], uuid.UUID) for i in (0, 2))


def bad_row(claim: Claim, offset: int = 1) -> list[NewEvent]:
    """A batch PostgreSQL refuses for what it holds (no such event type: a check violation)."""
    return [NewEvent(claim.last_seq + offset, cast(EventType, "no_such_event"), {"x": 1})]


async def test_a_tool_result_with_a_nul_is_stored_without_it_and_fails_no_run_of_its_batch(
        pool: asyncpg.Pool) -> None:
    """jsonb refuses the escape \\u0000 (SQLSTATE 22P05): one tool result holding a NUL failed
    the shared statement, and every run in it took that for a lost lease. The NUL is dropped
    where every journal payload passes, and each run of the batch lands."""
    claims = await claimed_runs(pool, 3)
    appends = Batcher(pool, lambda batches: append_events_many(pool, batches))
    emitters = [Emitter(pool, c, flush_interval_s=3600, appends=appends) for c in claims]
    results = [{"call_id": "call_1", "name": "read_file", "result": f"file {i}"}
               for i in range(3)]
    results[1]["result"] = "before\x00after"
    before = appends.batches
    outcomes = await asyncio.gather(
        *(e.event(EventType.TOOL_RESULT, r) for e, r in zip(emitters, results, strict=True)),
        return_exceptions=True)
    assert appends.batches - before == 1  # the three shared one statement
    assert outcomes == [None, None, None]
    assert [e.lost for e in emitters] == [None, None, None]
    for i, claim in enumerate(claims):
        rows = [r["payload"] for r in await read_journal(pool, claim.run_id)
                if r["type"] == EventType.TOOL_RESULT]
        assert rows == [{**results[i], "result": "beforeafter" if i == 1 else f"file {i}"}]


async def test_a_row_postgresql_refuses_fails_its_own_run_alone(pool: asyncpg.Pool) -> None:
    """A shared statement that fails for one run's rows is written again run by run: that run
    gets the error, the others land (journal appends and terminal writes alike)."""
    claims = await claimed_runs(pool, 6)
    outcomes = await append_events_many(pool, [
        (claims[0], delta(claims[0], "zero")), (claims[1], bad_row(claims[1])),
        (claims[2], delta(claims[2], "two"))])
    assert isinstance(outcomes[1], asyncpg.CheckViolationError)
    for i in (0, 2):
        assert not isinstance(outcomes[i], Exception)
        assert [r["payload"]["delta"] for r in await read_journal(pool, claims[i].run_id)
                if r["type"] == EventType.CONTENT_DELTA] == ["zero" if i == 0 else "two"]
    ending = claims[3:]
    ended = await finish_runs(pool, [
        Finish(ending[0], RunStatus.COMPLETED, ending[0].last_seq + 2,
               last=delta(ending[0], "answer"), content="answer"),
        Finish(ending[1], RunStatus.COMPLETED, ending[1].last_seq + 2,
               last=bad_row(ending[1]), content="never"),
        Finish(ending[2], RunStatus.COMPLETED, ending[2].last_seq + 1, content="done")])
    assert isinstance(ended[1], asyncpg.CheckViolationError)
    assert isinstance(ended[0], uuid.UUID) and isinstance(ended[2], uuid.UUID)
    statuses = dict(await pool.fetch("SELECT id, status FROM agent_run WHERE id = ANY($1)",
                                     [c.run_id for c in ending]))
    assert statuses == {ending[0].run_id: "completed", ending[1].run_id: "running",
                        ending[2].run_id: "completed"}


async def test_written_one_by_one_each_caller_gets_its_own_outcome(pool: asyncpg.Pool) -> None:
    """After a shared statement failed, its items are written one by one: one that fails
    there too gets its error, and the callers of the others get theirs, the ones written
    before it included (their rows landed)."""
    claims = await claimed_runs(pool, 4)
    taken, bad = claims[1], claims[2]
    await append_events_many(pool, [(taken, delta(taken, "first"))])  # its next seq is taken
    appends = Batcher(pool, lambda batches: append_events_many(pool, batches))
    batches = [(claims[0], delta(claims[0], "zero")), (taken, delta(taken, "again")),
               (bad, bad_row(bad)), (claims[3], delta(claims[3], "three"))]
    before = appends.batches
    outcomes = await asyncio.gather(*(append_events_batched(appends, c, events)
                                      for c, events in batches), return_exceptions=True)
    assert appends.batches - before == 1
    assert outcomes[0] is None and outcomes[3] is None
    assert isinstance(outcomes[1], SeqConflict)
    assert isinstance(outcomes[2], asyncpg.CheckViolationError)
    for i in (0, 3):
        assert [r["payload"]["delta"] for r in await read_journal(pool, claims[i].run_id)
                if r["type"] == EventType.CONTENT_DELTA] == ["zero" if i == 0 else "three"]
    # The same for terminal writes.
    ending = await claimed_runs(pool, 3)
    await append_events_many(pool, [(ending[1], delta(ending[1], "first"))])
    ended = await finish_runs(pool, [
        Finish(ending[0], RunStatus.COMPLETED, ending[0].last_seq + 1, content="done"),
        Finish(ending[1], RunStatus.COMPLETED, ending[1].last_seq + 1, content="taken"),
        Finish(ending[2], RunStatus.COMPLETED, ending[2].last_seq + 2,
               last=bad_row(ending[2]), content="never")])
    assert isinstance(ended[0], uuid.UUID)
    assert isinstance(ended[1], SeqConflict)
    assert isinstance(ended[2], asyncpg.CheckViolationError)


async def test_a_run_whose_row_another_transaction_holds_stops_no_other_run_of_its_batch(
        pool: asyncpg.Pool, dsn: str) -> None:
    """One run's row held past lock_timeout (a conversation being deleted, an operator's open
    transaction) failed the whole shared statement, and every run of the batch took that for a
    lost lease and stopped. The batch is written again run by run: the others land while the
    row is still held, and the held run's writer retries until it is let go, then lands."""
    from agentd import db as dbmod

    claims = await claimed_runs(pool, 3)
    held = claims[1]
    own = await dbmod.create_pool(dsn, min_size=1, max_size=4,
                                  timeouts=dbmod.DbTimeouts(lock_timeout_ms=100))
    holder = await asyncpg.connect(dsn)
    shared: list[int] = []

    async def write(batches: Sequence[JournalBatch]) -> list[Journaled | Exception]:
        shared.append(len(batches))
        return await append_events_many(own, batches)

    try:
        holding = holder.transaction()
        await holding.start()
        await holder.execute("SELECT 1 FROM agent_run WHERE id = $1 FOR UPDATE", held.run_id)
        appends = Batcher(own, write)
        emitters = [Emitter(own, c, flush_interval_s=3600, appends=appends) for c in claims]
        writes = [asyncio.ensure_future(e.event(EventType.TOOL_RESULT, {"n": i}))
                  for i, e in enumerate(emitters)]
        await asyncio.wait_for(asyncio.gather(writes[0], writes[2]), LONG_S)
        assert shared[0] == 3  # the three shared the statement the held row failed
        assert not writes[1].done()  # still retrying while the row is held
        await holding.rollback()
        await asyncio.wait_for(writes[1], LONG_S)
        assert [e.lost for e in emitters] == [None, None, None]
        # The held run retried in statements of its own: a shared one would have held every
        # other run in it for a lock_timeout at each retry.
        assert shared == [3]
        for i, claim in enumerate(claims):
            assert [r["payload"] for r in await read_journal(pool, claim.run_id)
                    if r["type"] == EventType.TOOL_RESULT] == [{"n": i}]
        # Terminal writes alike: the held run waits alone, the others end.
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM agent_run WHERE id = $1 FOR UPDATE",
                                 held.run_id)
            ended = await finish_runs(own, [
                Finish(c, RunStatus.COMPLETED, c.last_seq + 2, content="done") for c in claims])
        assert isinstance(ended[1], asyncpg.LockNotAvailableError)
        assert isinstance(ended[0], uuid.UUID) and isinstance(ended[2], uuid.UUID)
        statuses = dict(await pool.fetch("SELECT id, status FROM agent_run WHERE id = ANY($1)",
                                         [c.run_id for c in claims]))
        assert statuses == {claims[0].run_id: "completed", held.run_id: "running",
                            claims[2].run_id: "completed"}
    finally:
        await holder.close()
        await own.close()


async def test_runs_written_alone_do_not_wait_for_one_another(pool: asyncpg.Pool) -> None:
    """After a shared statement failed, a run written alone that waits (for a row another
    transaction holds) does not hold up the runs after it: they are written meanwhile."""
    from agentd.queue import _each_alone

    later_done = asyncio.Event()

    async def write(item: int) -> int:
        if item == 0:
            await later_done.wait()  # the first waits until both later ones are written
        elif item == 2:
            later_done.set()
        return item

    outcomes = await asyncio.wait_for(_each_alone(pool, [0, 1, 2], write), LONG_S)
    assert outcomes == [0, 1, 2]


async def test_a_lock_on_every_run_is_not_waited_for_run_by_run(pool: asyncpg.Pool,
                                                                dsn: str) -> None:
    """A lock held on the whole table (a migration's) fails the shared statement with a lock
    timeout as one run's row would. Written alone, the first few wait in vain as well, none
    landing: the others are answered with the same error at once instead of each waiting out
    a lock_timeout (a batch of 64, four at a time, waited sixteen of them)."""
    from agentd import db as dbmod
    from agentd.queue import _ALONE_AT_ONCE, _append_alone, _each_alone

    claims = await claimed_runs(pool, 20)
    own = await dbmod.create_pool(dsn, min_size=1, max_size=_ALONE_AT_ONCE,
                                  timeouts=dbmod.DbTimeouts(lock_timeout_ms=100))
    holder = await asyncpg.connect(dsn)
    tried = 0

    async def write(batch: JournalBatch) -> Journaled:
        nonlocal tried
        tried += 1
        return await _append_alone(own, *batch)

    try:
        async with holder.transaction():
            await holder.execute("LOCK TABLE agent_run IN EXCLUSIVE MODE")
            outcomes = await _each_alone(own, [(c, delta(c, "x")) for c in claims], write)
        assert all(isinstance(o, asyncpg.LockNotAvailableError) for o in outcomes)
        # The first wave, and the writes that started while it was failing.
        assert tried <= 2 * _ALONE_AT_ONCE - 1
    finally:
        await holder.close()
        await own.close()
