"""Enqueue is one atomic unit (message + run + journal 1-2 + wake) and idempotent by key.

Another account's conversation does not exist for the caller; a repeated Idempotency-Key never
mints a second run, however many callers race with it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from uuid import UUID

import asyncpg
import pytest

from agentd.queue import (
    ConversationNotFound,
    EnqueuedRun,
    IdempotencyConflict,
    NewRun,
    QueueFull,
    enqueue_runs,
)
from agentd.vocabulary import Channel, EventType, MessageRole, MessageStatus, RunStatus
from tests.integration.helpers import connections, listening, race, raise_unexpected
from tests.support.factories import enqueue, new_conversation, new_tenant
from tests.support.journal import read_journal, run_row

RACERS = 20


async def _row_counts(db: asyncpg.Pool) -> tuple[int, int, int]:
    row = await db.fetchrow(
        "SELECT (SELECT count(*) FROM agent_run) AS runs, (SELECT count(*) FROM message) AS msgs,"
        " (SELECT count(*) FROM run_event) AS events")
    return row["runs"], row["msgs"], row["events"]


async def test_enqueue_writes_message_run_and_journal_together_and_wakes_a_listener(
        dsn: str, pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    device_id = await pool.fetchval(
        "INSERT INTO device (account_id, name, token_hash) VALUES ($1, 'laptop', '\\x01')"
        " RETURNING id", tenant.account_id)
    request = {"content": "hello there", "model": "demo", "params": {"tokens": 3}}
    async with listening(dsn, Channel.RUN_ENQUEUED) as listener:
        result = await enqueue(pool, tenant.account_id, tenant.conversation_id, "hello there",
                               request=request, device_id=device_id)
        assert await listener.next() == str(tenant.conversation_id)

    assert result.created and result.status == RunStatus.QUEUED
    assert result.conversation_id == tenant.conversation_id
    run = await run_row(pool, result.run_id)
    assert run["status"] == RunStatus.QUEUED
    assert run["account_id"] == tenant.account_id
    assert run["origin_device_id"] == device_id
    assert run["request"] == request
    assert run["claim_token"] is None and run["fence"] is None and not run["cancel_requested"]

    messages = await pool.fetch("SELECT * FROM message WHERE conversation_id = $1",
                                tenant.conversation_id)
    assert len(messages) == 1
    message = messages[0]
    assert message["id"] == run["user_message_id"]
    assert message["run_id"] == result.run_id
    assert (message["role"], message["content"], message["status"]) == (
        MessageRole.USER, "hello there", MessageStatus.QUEUED)

    events = await read_journal(pool, result.run_id)
    assert [(e["seq"], e["type"]) for e in events] == [
        (1, EventType.USER_MESSAGE), (2, EventType.RUN_QUEUED)]
    # Payloads may grow fields (additive wire changes); these must be there as they are.
    assert events[0]["payload"].items() >= {
        "message_id": str(message["id"]), "role": "user", "content": "hello there"}.items()
    assert events[1]["payload"].items() >= {
        "run_id": str(result.run_id), "conversation_id": str(tenant.conversation_id),
        "device_id": str(device_id), "device": "laptop"}.items()
    # One commit: every row of the enqueue carries the same transaction id.
    xids = {events[0]["xid"], events[1]["xid"]}
    xids.add(await pool.fetchval("SELECT xmin::text FROM agent_run WHERE id = $1",
                                 result.run_id))
    xids.add(await pool.fetchval("SELECT xmin::text FROM message WHERE id = $1", message["id"]))
    assert len(xids) == 1


async def test_enqueue_that_fails_midway_leaves_nothing_and_wakes_nobody(
        dsn: str, pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    other = await new_conversation(pool, tenant.account_id)
    # Make the last write of the unit fail: everything before it must roll back with it.
    await pool.execute("""
        CREATE FUNCTION refuse_run_queued() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'journal refused'; END $$;
        CREATE TRIGGER refuse BEFORE INSERT ON run_event FOR EACH ROW
            WHEN (NEW.type = 'run_queued') EXECUTE FUNCTION refuse_run_queued();
    """)
    updated_at = await pool.fetchval("SELECT updated_at FROM conversation WHERE id = $1",
                                      tenant.conversation_id)
    async with listening(dsn, Channel.RUN_ENQUEUED) as listener:
        with pytest.raises(asyncpg.RaiseError, match="journal refused"):
            await enqueue(pool, tenant.account_id, tenant.conversation_id, "lost")
        assert await _row_counts(pool) == (0, 0, 0)
        assert await pool.fetchval("SELECT updated_at FROM conversation WHERE id = $1",
                                   tenant.conversation_id) == updated_at

        await pool.execute("DROP TRIGGER refuse ON run_event")
        await enqueue(pool, tenant.account_id, other, "kept")
        # Notifications arrive in commit order: had the failed enqueue woken anyone, its
        # payload would come before this one.
        assert await listener.next() == str(other)
        assert listener.drain() == []
    assert await _row_counts(pool) == (1, 1, 2)


async def test_enqueue_into_another_accounts_conversation_is_not_found_and_writes_nothing(
        pool: asyncpg.Pool) -> None:
    owner = await new_tenant(pool)
    intruder = await new_tenant(pool)
    await enqueue(pool, owner.account_id, owner.conversation_id, "mine")
    before = await _row_counts(pool)
    updated_at = await pool.fetchval("SELECT updated_at FROM conversation WHERE id = $1",
                                      owner.conversation_id)

    with pytest.raises(ConversationNotFound):
        await enqueue(pool, intruder.account_id, owner.conversation_id, "not yours")
    with pytest.raises(ConversationNotFound):
        await enqueue(pool, intruder.account_id, owner.conversation_id, "not yours",
                      idempotency_key="k-1")

    assert await _row_counts(pool) == before
    assert await pool.fetchval("SELECT updated_at FROM conversation WHERE id = $1",
                               owner.conversation_id) == updated_at


async def test_parallel_enqueues_with_one_idempotency_key_make_exactly_one_run(
        dsn: str, pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    async with connections(dsn, RACERS) as conns:
        for round_no in range(10):
            key = f"retry-{round_no}"
            results = await race(*(
                lambda conn=conn, key=key: enqueue(conn, tenant.account_id,
                                                   tenant.conversation_id, f"asked {key}",
                                                   idempotency_key=key)
                for conn in conns))
            raise_unexpected(results)
            assert all(isinstance(r, EnqueuedRun) for r in results)
            assert len({r.run_id for r in results}) == 1, "callers got different runs"
            assert sum(r.created for r in results) == 1
            run_id = results[0].run_id
            assert await pool.fetchval(
                "SELECT count(*) FROM agent_run WHERE account_id = $1 AND idempotency_key = $2",
                tenant.account_id, key) == 1
            assert [e["seq"] for e in await read_journal(pool, run_id)] == [1, 2]
    # The losers left no orphan message behind: one user message per round.
    assert await pool.fetchval("SELECT count(*) FROM message WHERE conversation_id = $1",
                               tenant.conversation_id) == 10
    assert await pool.fetchval("SELECT count(*) FROM agent_run") == 10


async def test_same_idempotency_key_with_another_request_is_a_conflict(
        pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    first = await enqueue(pool, tenant.account_id, tenant.conversation_id, "a",
                          request={"content": "a", "model": "demo"}, idempotency_key="k")
    again = await enqueue(pool, tenant.account_id, tenant.conversation_id, "a",
                          request={"model": "demo", "content": "a"}, idempotency_key="k")
    assert (again.run_id, again.created) == (first.run_id, False)

    with pytest.raises(IdempotencyConflict) as conflict:
        await enqueue(pool, tenant.account_id, tenant.conversation_id, "b",
                      request={"content": "b", "model": "demo"}, idempotency_key="k")
    assert conflict.value.run_id == first.run_id
    assert await pool.fetchval("SELECT count(*) FROM agent_run") == 1
    assert await pool.fetchval("SELECT count(*) FROM message") == 1


async def test_parallel_enqueues_of_two_payloads_under_one_key_split_into_run_and_conflicts(
        dsn: str, pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    async with connections(dsn, RACERS) as conns:
        for round_no in range(5):
            key = f"mixed-{round_no}"
            results = await race(*(
                lambda conn=conn, i=i, key=key: enqueue(conn, tenant.account_id,
                                                        tenant.conversation_id,
                                                        f"payload {i % 2}", idempotency_key=key)
                for i, conn in enumerate(conns)))
            raise_unexpected(results, IdempotencyConflict)
            runs = [r for r in results if isinstance(r, EnqueuedRun)]
            conflicts = [r for r in results if isinstance(r, IdempotencyConflict)]
            assert sum(r.created for r in runs) == 1
            winner = next(r.run_id for r in runs if r.created)
            winning_payload = next(i % 2 for i, r in enumerate(results)
                                   if isinstance(r, EnqueuedRun) and r.created)
            # Everyone who sent the winner's payload got the winner's run; the rest a conflict.
            for i, result in enumerate(results):
                if i % 2 == winning_payload:
                    assert isinstance(result, EnqueuedRun) and result.run_id == winner
                else:
                    assert isinstance(result, IdempotencyConflict) and result.run_id == winner
            assert len(conflicts) == RACERS // 2
    assert await pool.fetchval("SELECT count(*) FROM agent_run") == 5


async def test_idempotency_key_is_scoped_to_its_account(pool: asyncpg.Pool) -> None:
    one = await new_tenant(pool)
    two = await new_tenant(pool)
    a = await enqueue(pool, one.account_id, one.conversation_id, "same", idempotency_key="k")
    b = await enqueue(pool, two.account_id, two.conversation_id, "same", idempotency_key="k")
    assert a.created and b.created and a.run_id != b.run_id


async def test_same_key_for_other_content_or_another_conversation_is_a_conflict(
        pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    other = await new_conversation(pool, tenant.account_id)
    request = {"model": "demo"}
    first = await enqueue(pool, tenant.account_id, tenant.conversation_id, "delete my files",
                          request=request, idempotency_key="k")
    with pytest.raises(IdempotencyConflict):
        await enqueue(pool, tenant.account_id, tenant.conversation_id, "keep my files",
                      request=request, idempotency_key="k")
    with pytest.raises(IdempotencyConflict):
        await enqueue(pool, tenant.account_id, other, "delete my files", request=request,
                      idempotency_key="k")
    assert await pool.fetchval("SELECT count(*) FROM agent_run") == 1
    assert first.created


async def test_turns_enqueued_together_each_get_their_own_outcome_in_order(
        pool: asyncpg.Pool) -> None:
    """One statement, one outcome per turn, in the order asked: a run for each that fits, the
    first run for a repeated key, and for the others what refused them — with nothing written
    for those. (When a call's turns do not all fit, which of them are refused is not
    defined; never more than fit are queued.)"""
    tenant = await new_tenant(pool)
    other = await new_tenant(pool)
    second = await new_conversation(pool, tenant.account_id)
    await pool.execute("UPDATE account SET max_queued = 4 WHERE id = $1", tenant.account_id)
    first = await enqueue(pool, tenant.account_id, tenant.conversation_id, "earlier",
                          idempotency_key="k")
    before = await _row_counts(pool)
    asks = [NewRun(tenant.conversation_id, "one", {"content": "one", "model": "demo"}),
            NewRun(other.conversation_id, "not mine", {"content": "x", "model": "demo"}),
            NewRun(tenant.conversation_id, "earlier", {"content": "earlier", "model": "demo"},
                   idempotency_key="k"),
            NewRun(second, "two", {"content": "two", "model": "demo"}),
            NewRun(tenant.conversation_id, "three", {"content": "three", "model": "demo"}),
            NewRun(second, "four", {"content": "four", "model": "demo"}),
            NewRun(tenant.conversation_id, "earlier", {"content": "changed", "model": "demo"},
                   idempotency_key="k")]
    outcomes = await enqueue_runs(pool, account_id=tenant.account_id, runs=asks)
    assert len(outcomes) == len(asks)
    assert isinstance(outcomes[1], ConversationNotFound)
    replay = outcomes[2]
    assert isinstance(replay, EnqueuedRun) and not replay.created
    assert replay.run_id == first.run_id
    assert isinstance(outcomes[6], IdempotencyConflict)
    new = [outcomes[i] for i in (0, 3, 4, 5)]
    made = [o for o in new if isinstance(o, EnqueuedRun)]
    refused = [o for o in new if isinstance(o, QueueFull)]
    assert (len(made), len(refused)) == (3, 1), "room for three more beside the earlier turn"
    assert refused[0].max_queued == 4
    runs, messages, events = await _row_counts(pool)
    assert (runs, messages, events) == (before[0] + 3, before[1] + 3, before[2] + 6)
    # Turns of one conversation are created in the order they were asked.
    created = [r["id"] for r in await pool.fetch(
        "SELECT id FROM agent_run WHERE account_id = $1 ORDER BY created_at, id",
        tenant.account_id)]
    asked_order = [o.run_id for o in new if isinstance(o, EnqueuedRun)]
    assert [r for r in created if r in asked_order] == asked_order


async def test_batches_racing_for_few_queue_slots_keep_their_order_and_the_limit(
        dsn: str, pool: asyncpg.Pool) -> None:
    """Callers of one account, each enqueueing turns of two conversations in one call, race for
    fewer queue slots than they ask for (independent sessions, many rounds): never more turns
    queued than the limit, and each call's turns of a conversation created in the order asked
    (a turn retried after later ones were created would run out of order)."""
    callers, per_call, limit = 4, 6, 10
    tenant = await new_tenant(pool)
    await pool.execute("UPDATE account SET max_queued = $2 WHERE id = $1", tenant.account_id,
                       limit)
    async with connections(dsn, callers) as conns:
        for round_ in range(25):
            mine = [(tenant.conversation_id, await new_conversation(pool, tenant.account_id))
                    for _ in range(callers)]

            def call(conn: asyncpg.Connection, convs: tuple[UUID, UUID], c: int,
                     round_: int = round_) -> Callable[[], Awaitable[list[object]]]:
                asks = [NewRun(convs[i % 2], f"r{round_} c{c} t{i}",
                               {"content": f"t{i}", "model": "demo"}) for i in range(per_call)]
                return lambda: enqueue_runs(conn, account_id=tenant.account_id, runs=asks)

            results = await race(*(call(conn, convs, c) for c, (conn, convs)
                                   in enumerate(zip(conns, mine, strict=True))))
            raise_unexpected(results, context=f"round {round_}")
            made = [[o.run_id for o in outcomes if isinstance(o, EnqueuedRun)]
                    for outcomes in results]
            refused = sum(isinstance(o, QueueFull) for outcomes in results for o in outcomes)
            assert sum(map(len, made)) + refused == callers * per_call
            assert sum(map(len, made)) == limit, f"round {round_}: exactly the free slots"
            for run_ids in made:
                created = [r["id"] for r in await pool.fetch(
                    "SELECT id FROM agent_run WHERE id = ANY($1::uuid[])"
                    " ORDER BY created_at, id", run_ids)]
                assert created == run_ids, f"round {round_}: created out of the asked order"
            await pool.execute("UPDATE agent_run SET status = 'cancelled', slot = NULL,"
                               " finished_at = now()"
                               " WHERE account_id = $1 AND status = 'queued'",
                               tenant.account_id)


async def test_a_slot_filled_and_freed_without_pause_is_never_handed_out_twice(
        dsn: str, pool: asyncpg.Pool) -> None:
    """One queue slot, filled and emptied by independent sessions without pause: a rival that
    commits the slot just before we lock it must be seen, so every enqueue either creates its
    turn or is refused as full; none takes the slot only to have its insert turned away."""
    racers, attempts = 6, 300
    tenant = await new_tenant(pool)
    await pool.execute("UPDATE account SET max_queued = 1 WHERE id = $1", tenant.account_id)
    convs = [await new_conversation(pool, tenant.account_id) for _ in range(racers)]
    made = refused = 0

    async def churn(conn: asyncpg.Connection, conv: UUID) -> None:
        nonlocal made, refused
        for n in range(attempts):
            [outcome] = await enqueue_runs(conn, account_id=tenant.account_id, runs=[
                NewRun(conv, f"t{n}", {"content": f"t{n}", "model": "demo"})])
            if isinstance(outcome, QueueFull):
                refused += 1
                continue
            assert isinstance(outcome, EnqueuedRun)
            made += 1
            await conn.execute("UPDATE agent_run SET status = 'cancelled', slot = NULL,"
                               " finished_at = now() WHERE id = $1", outcome.run_id)

    async with connections(dsn, racers) as conns:
        results = await race(*(lambda conn=conn, conv=conv: churn(conn, conv)
                               for conn, conv in zip(conns, convs, strict=True)))
    raise_unexpected(results)
    assert made + refused == racers * attempts
    assert made > 0 and refused > 0, "the slot was contended"


async def test_enqueues_into_one_conversation_never_deadlock(dsn: str) -> None:
    """Enqueues into one conversation meet each other and a writer that key-share-locks its row
    (an answer message, through its foreign key), round after round on separate sessions. Each
    enqueue locks the conversation's row in a statement of its own and updates it in the next
    (sql/022). When one statement locked the row and updated it in a later part, this test
    deadlocked within a few hundred rounds every time it was run (seven runs, PostgreSQL 15
    and 18): the update went back to the version the statement began with, where a rival was
    queued waiting for the statement's own transaction."""
    rounds = 400
    async with connections(dsn, 5) as conns:
        setup, keysharer, enqueuers = conns[0], conns[1], conns[2:]
        tenant = await new_tenant(setup)

        async def share_lock() -> None:
            await keysharer.execute(
                "INSERT INTO message (conversation_id, role, content, status)"
                " VALUES ($1, 'assistant', 'answer', 'complete')", tenant.conversation_id)

        async def post(conn: asyncpg.Connection, content: str) -> None:
            await enqueue(conn, tenant.account_id, tenant.conversation_id, content,
                          default_max_queued=10_000)

        for round_ in range(rounds):
            results = await race(share_lock, *(
                lambda conn=conn, text=f"round {round_} {i}": post(conn, text)
                for i, conn in enumerate(enqueuers)))
            raise_unexpected(results, context=f"round {round_}")
        assert await setup.fetchval("SELECT count(*) FROM agent_run") == rounds * len(enqueuers)
