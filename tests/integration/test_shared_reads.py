"""One read per wake: N tails of one run in one process share each journal read, and every one
of them still gets the exact text; a read already sent is never joined by a later asker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from uuid import UUID

import asyncpg

from agentd import db as dbmod
from agentd.executor import Journaled, TurnRunner
from agentd.group_commit import Batcher
from agentd.heartbeat import LeaseKeeper
from agentd.hub import Hub
from agentd.journal import Emitter
from agentd.metrics import Metrics
from agentd.notifier import Notifier
from agentd.providers import ProviderRegistry
from agentd.queue import (
    Claim,
    Event,
    NewEvent,
    SeqConflict,
    WorkerReport,
    append_events_batched,
    append_events_many,
    claim_runs,
    finish_run,
    finish_runs,
    read_events,
    reap_expired,
)
from agentd.settings import load_settings
from agentd.shared_reads import SharedReads
from agentd.tail import FeedCursor, FeedItem, Recheck, conversation_feed, run_tail
from agentd.tools import default_tools
from agentd.vocabulary import Channel, EventType, RunStatus
from tests.integration.helpers import DEFAULT_TIMEOUT_S
from tests.support.daemon import poll_until
from tests.support.factories import enqueue, new_tenant

TAILS = 25
WAKES = 6
LONG_S = 60.0


async def start_run(pool: asyncpg.Pool) -> Claim:
    tenant = await new_tenant(pool)
    await enqueue(pool, tenant.account_id, tenant.conversation_id, "go")
    [claim] = await claim_runs(pool, worker_id="worker", lease_ttl_s=LONG_S)
    return claim


@contextlib.asynccontextmanager
async def own_run(pool: asyncpg.Pool, dsn: str) -> AsyncIterator[
        tuple[Hub, Notifier, Claim, SharedReads, Emitter]]:
    """A running turn whose journal this process writes as the daemon does: its batches go by
    group commit and are handed to the process's shared reads, and its hints wake the process's
    subscribers at once (the hub and the notifier, closed on exit)."""
    hub = Hub(dsn)
    await hub.start()
    notifier = Notifier(pool, local=hub)
    notifier.start()
    try:
        appends = Batcher(pool, lambda batches: append_events_many(pool, batches))
        claim = await start_run(pool)
        reads = SharedReads(pool)
        emitter = Emitter(pool, claim, flush_interval_s=3600, hint=notifier.notify_rows_at_hand,
                          appends=appends, journaled=reads.journaled)
        yield hub, notifier, claim, reads, emitter
    finally:
        await notifier.close()
        await hub.close()


async def test_tails_of_one_run_woken_together_cause_one_read_per_wake_and_get_exact_text(
        pool: asyncpg.Pool, hub: Hub, notifier: Notifier) -> None:
    claim = await start_run(pool)
    reads = SharedReads(pool)
    # Deltas written one row each (an interval never reached: only flush() writes).
    emitter = Emitter(pool, claim, flush_interval_s=3600, hint=notifier.notify)
    got: list[list[str]] = [[] for _ in range(TAILS)]
    ended: list[bool] = [False] * TAILS

    async def tail(i: int) -> None:
        async for event in run_tail(pool, hub, claim.run_id, claim.last_seq, keepalive_s=3600,
                                    reads=reads):
            if event is not None and event.type == EventType.CONTENT_DELTA:
                got[i].append(event.payload["delta"])
        ended[i] = True

    tasks = [asyncio.create_task(tail(i)) for i in range(TAILS)]
    pieces = [f"piece {n} ü✓ " for n in range(WAKES + 1)]

    async def everyone_has(count: int) -> bool:
        return all(len(g) == count for g in got)

    async def everyone_waits() -> bool:
        # Every tail idle on the hub: none is still finishing a read or a check of the run row,
        # which would make it miss the next hint's loop step and read on its own.
        subs = hub.subscribers(Channel.RUN_EVENT, str(claim.run_id))
        return len(subs) == TAILS and all(s.waiting for s in subs)

    try:
        # Warm-up: once every tail has the first delta, every tail waits on the hub (a tail
        # goes from handing out an event to waiting without another read).
        await emitter.delta(pieces[0])
        await poll_until(lambda: everyone_has(1), DEFAULT_TIMEOUT_S, interval=0.002,
                         what="every tail to get the first delta")
        await poll_until(everyone_waits, DEFAULT_TIMEOUT_S, interval=0.002,
                         what="every tail to wait on the hub")
        asked, issued = reads.asked, reads.issued
        for n in range(1, WAKES + 1):
            await poll_until(everyone_waits, DEFAULT_TIMEOUT_S, interval=0.002,
                             what="every tail to wait on the hub")
            await emitter.delta(pieces[n])
            await emitter.flush()
            await poll_until(lambda n=n: everyone_has(n + 1), DEFAULT_TIMEOUT_S, interval=0.002,
                                 what=f"every tail to get delta {n}")
        assert reads.asked - asked == TAILS * WAKES
        assert reads.issued - issued == WAKES, "one journal read per wake, not one per tail"

        await finish_run(pool, claim, RunStatus.COMPLETED, seq=emitter.next_seq,
                         content="".join(pieces), hint=notifier.notify)
        await poll_until(lambda: all(ended), DEFAULT_TIMEOUT_S, interval=0.002,
                         what="every tail to end at complete")
        assert all("".join(g) == "".join(pieces) for g in got)
    finally:
        await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_read_already_sent_is_not_joined_by_a_later_asker(pool: asyncpg.Pool) -> None:
    claim = await start_run(pool)
    reads = SharedReads(pool)
    first = asyncio.create_task(reads.events(claim.run_id, claim.last_seq, 500))
    await poll_until(lambda: reads.issued == 1, DEFAULT_TIMEOUT_S, interval=0.002,
                     what="the first query sent")
    emitter = Emitter(pool, claim, flush_interval_s=3600)
    await emitter.delta("after the first read was sent")
    second = await reads.events(claim.run_id, claim.last_seq, 500)
    await first
    assert reads.issued == 2
    assert [e.seq for e in second] == [e.seq for e in await read_events(
        pool, claim.run_id, after_seq=claim.last_seq)]
    assert second[-1].payload["delta"] == "after the first read was sent"


async def test_askers_in_one_loop_step_share_and_a_failure_reaches_each(
        pool: asyncpg.Pool, dsn: str) -> None:
    claim = await start_run(pool)
    own = await dbmod.create_pool(dsn, min_size=1, max_size=2)
    reads = SharedReads(own)
    same = await asyncio.gather(*(reads.events(claim.run_id, 0, 500) for _ in range(10)))
    assert reads.issued == 1 and reads.asked == 10
    assert all(s is same[0] for s in same)
    await own.close()  # a closed pool: the one query fails, and so does each asker's read
    results = await asyncio.gather(*(reads.events(claim.run_id, 0, 500) for _ in range(3)),
                                   return_exceptions=True)
    assert reads.issued == 2
    assert all(isinstance(r, asyncpg.InterfaceError) for r in results), results


async def test_reads_of_different_runs_in_one_loop_step_go_out_as_one_query(
        pool: asyncpg.Pool) -> None:
    claims = [await start_run(pool) for _ in range(6)]
    for n, claim in enumerate(claims):
        emitter = Emitter(pool, claim, flush_interval_s=3600)
        for i in range(n + 1):
            await emitter.delta(f"run {n} piece {i} ")
            await emitter.flush()
    reads = SharedReads(pool)
    # Every run from its start, and the last run also from a later cursor (its own pair).
    cursors = [(c.run_id, c.last_seq) for c in claims] + [(claims[-1].run_id,
                                                            claims[-1].last_seq + 3)]
    got = await asyncio.gather(*(reads.events(run_id, seq, 500) for run_id, seq in cursors))
    assert reads.issued == 1 and reads.asked == len(cursors)
    for (run_id, seq), events in zip(cursors, got, strict=True):
        assert events == await read_events(pool, run_id, after_seq=seq, limit=500)
        assert events  # nothing trivially equal


async def test_tails_of_a_run_this_process_writes_are_handed_its_rows_and_read_nothing(
        pool: asyncpg.Pool, dsn: str) -> None:
    """The writer hands each committed batch to the process's tails before it wakes them: past
    their first read they read nothing back, yet get every row as the journal holds it; a hint
    from elsewhere (another writer: here a finalizer's complete) still sends them to the
    database."""
    async with own_run(pool, dsn) as (hub, _notifier, claim, reads, emitter):
        got: list[list[Event]] = [[] for _ in range(3)]

        async def tail(i: int) -> None:
            async for event in run_tail(pool, hub, claim.run_id, claim.last_seq, keepalive_s=3600,
                                        reads=reads):
                if event is not None:
                    got[i].append(event)

        tasks = [asyncio.create_task(tail(i)) for i in range(3)]
        try:
            await emitter.delta("first ")
            await poll_until(lambda: all(len(g) == 1 for g in got), DEFAULT_TIMEOUT_S,
                             interval=0.002, what="every tail to get the first delta")
            issued = reads.issued
            for n in range(WAKES):
                await emitter.delta(f"piece {n} ")
                await emitter.flush()
                await poll_until(lambda n=n: all(len(g) == n + 2 for g in got),
                                 DEFAULT_TIMEOUT_S, interval=0.002, what=f"every tail at {n}")
            assert reads.issued == issued, "the writer's own rows were read back"
            assert reads.served_held >= 3 * WAKES
            # Another writer's row (a finalizer ending the run) announces itself by NOTIFY only.
            stopped = await reap_now(pool, claim)
            await poll_until(lambda: all(g[-1].type == EventType.COMPLETE for g in got),
                             DEFAULT_TIMEOUT_S, interval=0.002, what="every tail at complete")
            assert reads.issued > issued and stopped
            journal = await read_events(pool, claim.run_id, after_seq=claim.last_seq)
            for g in got:
                assert [(e.seq, e.type, e.payload, e.created_at) for e in g] == \
                    [(e.seq, e.type, e.payload, e.created_at) for e in journal]
        finally:
            await _cancel(tasks)


async def test_a_feed_hands_out_a_delta_while_its_conversation_re_read_is_under_way(
        pool: asyncpg.Pool, dsn: str) -> None:
    """A conversation feed re-reads its conversation (lease, presence) when a turn starts or
    ends. A first delta committed meanwhile goes out at once, not after that re-read; a re-read
    asked for while one is under way (the turn ended) runs again once it is back."""
    async with own_run(pool, dsn) as (hub, notifier, claim, reads, emitter):
        gate = asyncio.Event()  # the re-reads wait for it: one is under way until the test says
        calls = 0

        async def recheck() -> Recheck:
            nonlocal calls
            calls += 1
            asked = calls
            await gate.wait()
            return Recheck({"id": "kept"}, {"re_read": asked}, [])

        items: list[FeedItem] = []

        async def feed() -> None:
            async for item in conversation_feed(pool, hub, claim.conversation_id, FeedCursor(),
                                                keepalive_s=3600, recheck=recheck,
                                                meta_seen={"id": "kept"}, reads=reads):
                items.append(item)

        def events(kind: EventType) -> list[FeedItem]:
            return [i for i in items if i.event is not None and i.event.type == kind]

        task = asyncio.create_task(feed())
        try:
            # The first pass hands out the turn so far; its run_started asks for a re-read.
            await poll_until(lambda: calls == 1 and bool(events(EventType.RUN_STARTED)),
                             DEFAULT_TIMEOUT_S, interval=0.002, what="the feed's first re-read")
            await emitter.delta("first ")
            await poll_until(lambda: bool(events(EventType.CONTENT_DELTA)),
                             DEFAULT_TIMEOUT_S, interval=0.002,
                             what="the delta, while the re-read is under way")
            assert calls == 1 and not [i for i in items if i.kind == "lease"]
            # The turn ends while that re-read is still out: its ending needs a later one.
            await finish_run(pool, claim, RunStatus.COMPLETED, seq=emitter.next_seq,
                             content="first ", hint=notifier.notify)
            await poll_until(lambda: bool(events(EventType.COMPLETE)), DEFAULT_TIMEOUT_S,
                             interval=0.002, what="the ending, while the re-read is under way")
            assert calls == 1
            gate.set()
            await poll_until(lambda: len([i for i in items if i.kind == "lease"]) == 2,
                             DEFAULT_TIMEOUT_S, interval=0.002, what="both re-reads' leases")
            assert [i.data for i in items if i.kind == "lease"] == [{"re_read": 1}, {"re_read": 2}]
            assert calls == 2
            assert [i.event.payload["delta"] for i in events(EventType.CONTENT_DELTA)
                    if i.event is not None] == ["first "]
        finally:
            await _cancel([task])


async def reap_now(pool: asyncpg.Pool, claim: Claim) -> bool:
    """End the run as a finalizer in another process would: its lease made due, the reaper
    run (it journals complete and sends its own NOTIFY)."""
    await pool.execute("UPDATE agent_run SET lease_expires_at = clock_timestamp()"
                       " WHERE id = $1", claim.run_id)
    return claim.run_id in await reap_expired(pool)


# Shorter than a tail's poll while NOTIFY works (tail.poll_interval: 5 s): what it gets within
# this, a hint got it there.
BEFORE_ITS_POLL_S = 3.0


async def test_a_batch_written_alone_sends_the_tails_its_hint_wakes_to_the_database(
        pool: asyncpg.Pool, dsn: str) -> None:
    """A shared statement that failed is written again batch by batch, and the rows of those
    writes are not handed over: a tail woken by their "rows at hand" hint must read them, not
    find nothing newer held and send nothing until its next poll."""
    async with own_run(pool, dsn) as (hub, notifier, claim, reads, _emitter):
        appends = Batcher(pool, lambda batches: append_events_many(pool, batches))
        emitter = Emitter(pool, claim, flush_interval_s=3600,
                          hint=notifier.notify_rows_at_hand, appends=appends,
                          journaled=reads.journaled)
        got: list[Event] = []

        async def tail() -> None:
            async for event in run_tail(pool, hub, claim.run_id, claim.last_seq,
                                        keepalive_s=3600, reads=reads):
                if event is not None:
                    got.append(event)

        task = asyncio.create_task(tail())
        try:
            await emitter.delta("first ")  # handed over: the tail takes it from what is held
            await poll_until(lambda: len(got) == 1, DEFAULT_TIMEOUT_S, interval=0.002,
                             what="the tail to get the first delta")
            # Another run, whose next seq someone took, shares the next statement: it fails
            # whole, and each batch is written alone.
            other = await start_run(pool)
            taken = [NewEvent(other.last_seq + 1, EventType.CONTENT_DELTA, {"delta": "x"})]
            await append_events_many(pool, [(other, taken)])
            await emitter.delta("second")
            before = appends.batches
            outcomes = await asyncio.gather(emitter.flush(),
                                            append_events_batched(appends, other, taken),
                                            return_exceptions=True)
            assert appends.batches - before == 1
            assert outcomes[0] is None and isinstance(outcomes[1], SeqConflict)
            await poll_until(lambda: len(got) == 2, BEFORE_ITS_POLL_S, interval=0.002,
                             what="the tail to get the batch written alone")
            assert got[1].payload == {"delta": "second"}
        finally:
            await _cancel([task])


async def test_a_turn_that_ends_in_this_process_lets_go_of_its_held_rows(
        pool: asyncpg.Pool, dsn: str, tmp_path: Path) -> None:
    """A turn's `complete` is written by its terminal write's SQL and never handed over: its
    rows held for the process's tails are let go when the turn ends here, not kept until
    other runs push them out."""
    config = tmp_path / "agentd.toml"
    config.write_text("")
    settings = load_settings(config, env={"AGENTD_HEARTBEAT_S": "1", "AGENTD_FLUSH_MS": "20"})
    async with own_run(pool, dsn) as (hub, notifier, _claim, reads, _emitter):
        keeper = LeaseKeeper(dsn, hub, settings, Metrics(),
                             report=lambda: WorkerReport("held-rows-worker", "test", 0))
        keeper.start()
        providers = ProviderRegistry(settings)
        handed: list[UUID] = []

        def rows(run_id: UUID, events: Sequence[Event]) -> None:
            handed.append(run_id)
            reads.journaled(run_id, events)

        try:
            runner = TurnRunner(
                pool, hub, keeper, settings, providers, default_tools(), hint=notifier.notify,
                finishes=Batcher(pool, lambda items: finish_runs(pool, items)),
                appends=Batcher(pool, lambda batches: append_events_many(pool, batches)),
                journaled=Journaled(rows, notifier.notify_rows_at_hand, reads.ended))
            tenant = await new_tenant(pool)
            run = await enqueue(pool, tenant.account_id, tenant.conversation_id, "go",
                                request={"content": "go", "model": "demo",
                                         "params": {"tokens": 5, "delay_ms": 0}})
            [claim] = await claim_runs(pool, worker_id="held-rows-worker", lease_ttl_s=LONG_S)
            assert claim.run_id == run.run_id
            assert await runner.run(claim)
            assert claim.run_id in handed, "no row of the turn was held: nothing was proven"
            assert reads.held_after(claim.run_id, claim.last_seq) is None
            status = await pool.fetchval("SELECT status FROM agent_run WHERE id = $1",
                                         claim.run_id)
            assert status == RunStatus.COMPLETED
        finally:
            await keeper.close()
            await providers.close()


async def test_a_row_this_version_cannot_read_fails_only_its_own_runs_reads(
        pool: asyncpg.Pool) -> None:
    """A newer agentd in the same fleet (a rolling deploy) may journal an event type this one
    does not know: the tails of that run see their read fail, and the other runs whose reads
    shared its query still get their rows."""
    claims = [await start_run(pool) for _ in range(3)]
    for claim in claims:
        emitter = Emitter(pool, claim, flush_interval_s=3600)
        await emitter.delta(f"text of {claim.run_id}")
        await emitter.flush()
    odd = claims[1]
    await pool.execute("ALTER TABLE run_event DROP CONSTRAINT run_event_type_check")
    await pool.execute(
        "INSERT INTO run_event (run_id, seq, type, payload) SELECT $1, max(seq) + 1,"
        " 'a_newer_type', '{}' FROM run_event WHERE run_id = $1", odd.run_id)
    reads = SharedReads(pool)
    got = await asyncio.gather(*(reads.events(c.run_id, c.last_seq, 500) for c in claims),
                               return_exceptions=True)
    assert isinstance(got[1], ValueError), got[1]
    for claim, events in zip(claims, got, strict=True):
        if claim is not odd:
            assert events == await read_events(pool, claim.run_id, after_seq=claim.last_seq)
            assert isinstance(events, list) and events[-1].payload["delta"].startswith("text")
    assert reads.issued == 1  # the other runs were not read again


async def test_a_read_cancelled_before_it_is_sent_leaves_no_reader_waiting(
        pool: asyncpg.Pool) -> None:
    """The task that sends a shared read can be cancelled in the loop step it waits for others
    to join (the loop is closing): its readers are told, and the next ask is sent on its own
    rather than joined to a read no task will send."""
    claim = await start_run(pool)
    reads = SharedReads(pool)
    never = (datetime(1970, 1, 1, tzinfo=UTC), UUID(int=0))
    asks: list[Callable[[], Awaitable[object]]] = [
        lambda: reads.events(claim.run_id, 0, 500),
        lambda: reads.runs(claim.conversation_id, never, []),
    ]
    for ask in asks:
        waiting = asyncio.create_task(ask())
        await poll_until(lambda: len(reads._tasks) == 1, DEFAULT_TIMEOUT_S, interval=0,
                         what="the read's task started")
        [flight] = reads._tasks
        flight.cancel()
        done, _ = await asyncio.wait([waiting], timeout=DEFAULT_TIMEOUT_S)
        assert done, "a reader of the cancelled read was left waiting"
        assert waiting.cancelled()
        again = await asyncio.wait_for(ask(), DEFAULT_TIMEOUT_S)
        assert again, "the next ask read nothing"
