"""A post writes no row that other transactions lock and then undoes the write (sql/022).

A post used to update its conversation's row in a subtransaction and roll that back (a refused
post, a turn that could not start at once), and a claim beside an enqueue that picked another turn
started it and moved its account's round-robin clock before rolling both back. Parallel posts
key-share-lock those rows (the foreign keys of what they insert) and update them, and PostgreSQL 18
failed such a rival's update with an internal error, "new multixact has more than one updating
member", which the client saw as a 500 (tests/streams/test_idempotency.py, once in a CI run).

That race is a moment wide; what makes it possible is an undone write, and that is checked here
for every way a post can go. PostgreSQL's per-transaction counters
(pg_stat_get_xact_tuples_updated) count an update that a subtransaction undid too, so within the
post's transaction they must show exactly the updates the post keeps.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from uuid import UUID

import asyncpg
import pytest

from agentd.queue import (
    Claim,
    ClaimBeside,
    Db,
    EnqueuedRun,
    IdempotencyConflict,
    NewRun,
    QueueFull,
    enqueue_runs,
    post_turn,
)
from agentd.vocabulary import RunStatus
from tests.support.factories import enqueue, new_conversation, new_tenant, post_beside
from tests.support.journal import run_row

LEASE_S = 60.0
TABLES = ("conversation", "account", "agent_run", "message", "conversation_lease")


async def _updates_in(dsn: str, post: Callable[[asyncpg.Connection], Awaitable[object]],
                      ) -> dict[str, int]:
    """Rows of each table the post updated in its transaction, kept or undone. On a session of
    its own: the counters also hold what earlier transactions of the session did until the
    session reports them (at most once a second, when idle)."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await post(conn)
            return dict(await conn.fetch(
                "SELECT t, pg_stat_get_xact_tuples_updated(t::regclass)"
                " FROM unnest($1::text[]) t", TABLES))
    finally:
        await conn.close()


def _post(account_id: UUID, conversation_id: UUID, content: str, *, key: str | None = None,
          max_queued: int = 100,
          ) -> Callable[[Db], Awaitable[tuple[EnqueuedRun, Claim | None]]]:
    """A post as the daemon sends it with a free slot of its process."""
    turn = NewRun(conversation_id, content, {"content": content, "model": "demo"}, key)
    return lambda conn: post_turn(conn, account_id=account_id, turn=turn,
                                  claim=ClaimBeside("w", LEASE_S), default_max_queued=max_queued)


def _only(**kept: int) -> dict[str, int]:
    return {table: kept.get(table, 0) for table in TABLES}


async def test_a_turn_started_into_an_empty_line_updates_its_conversation_and_account_once(
        dsn: str, pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    updates = await _updates_in(dsn, _post(tenant.account_id, tenant.conversation_id, "now"))
    # The account's round-robin clock and the conversation list's order: nothing undone.
    assert updates == _only(conversation=1, account=1)


async def test_a_turn_queued_behind_its_conversations_running_turn_updates_the_row_once(
        dsn: str, pool: asyncpg.Pool) -> None:
    """Nothing is queued, so the direct start is tried; the conversation runs a turn, so it
    declines and the post enqueues. The direct start used to have updated the row already."""
    tenant = await new_tenant(pool)
    _, [running] = await post_beside(pool, tenant.account_id, tenant.conversation_id, "first",
                                     "w", LEASE_S)
    updates = await _updates_in(dsn, _post(tenant.account_id, tenant.conversation_id, "second"))
    assert updates == _only(conversation=1)
    assert (await run_row(pool, running.run_id))["status"] == RunStatus.RUNNING
    assert await pool.fetchval("SELECT count(*) FROM agent_run WHERE status = 'queued'") == 1


async def test_a_claim_beside_that_picks_another_accounts_turn_writes_nothing_of_it(
        dsn: str, pool: asyncpg.Pool) -> None:
    """Another account was served longer ago (never), so the fair claim beside this post picks
    that account's queued turn, which the post does not keep."""
    poster = await new_tenant(pool)
    await post_beside(pool, poster.account_id, poster.conversation_id, "served", "w", LEASE_S)
    waiting = await new_tenant(pool)
    first = await enqueue(pool, waiting.account_id, waiting.conversation_id, "waiting")
    elsewhere = await new_conversation(pool, poster.account_id)
    updates = await _updates_in(dsn, _post(poster.account_id, elsewhere, "mine"))
    assert updates == _only(conversation=1)
    # Both left queued for the claim loops, in their fair order.
    assert (await run_row(pool, first.run_id))["status"] == RunStatus.QUEUED
    assert await pool.fetchval("SELECT count(*) FROM agent_run WHERE status = 'queued'") == 2


async def test_a_claim_beside_that_cannot_take_the_conversation_lease_writes_nothing(
        dsn: str, pool: asyncpg.Pool) -> None:
    """The last step of a claim that can fail is taking the conversation's lease (another
    session holds the lease row: a late release of the turn before); the account's round-robin
    clock is moved after it, so the undone claim wrote nothing others lock."""
    tenant = await new_tenant(pool)
    _, [first] = await post_beside(pool, tenant.account_id, tenant.conversation_id, "first",
                                   "w", LEASE_S)
    await pool.execute("UPDATE agent_run SET status = 'completed', finished_at = now()"
                       " WHERE id = $1", first.run_id)
    holder = await asyncpg.connect(dsn)
    release = holder.transaction()
    await release.start()
    try:
        await holder.execute("DELETE FROM conversation_lease WHERE conversation_id = $1",
                             tenant.conversation_id)

        async def held_out(conn: asyncpg.Connection) -> None:
            await conn.execute("SET LOCAL lock_timeout = '200ms'")
            run, claim = await _post(tenant.account_id, tenant.conversation_id, "second")(conn)
            assert run.status == RunStatus.QUEUED and claim is None

        updates = await _updates_in(dsn, held_out)
    finally:
        await release.rollback()
        await holder.close()
    # The claim also wrote and undid the post's own run and question, rows no other
    # transaction can see before the post commits.
    assert {t: updates[t] for t in ("conversation", "account", "conversation_lease")} == {
        "conversation": 1, "account": 0, "conversation_lease": 0}


async def test_a_post_refused_for_its_used_key_updates_nothing(
        dsn: str, pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    await _post(tenant.account_id, tenant.conversation_id, "first", key="k")(pool)

    async def other_payload(conn: asyncpg.Connection) -> None:
        with pytest.raises(IdempotencyConflict):
            await _post(tenant.account_id, tenant.conversation_id, "other", key="k")(conn)

    assert await _updates_in(dsn, other_payload) == _only()


async def test_a_post_refused_for_a_full_queue_updates_nothing(
        dsn: str, pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)

    async def full(conn: asyncpg.Connection) -> None:
        with pytest.raises(QueueFull):
            await _post(tenant.account_id, tenant.conversation_id, "no room", max_queued=0)(conn)

    assert await _updates_in(dsn, full) == _only()
    assert await pool.fetchval("SELECT count(*) FROM agent_run") == 0


async def test_an_enqueue_of_several_turns_moves_only_the_conversations_it_wrote_into(
        dsn: str, pool: asyncpg.Pool) -> None:
    """The many-turn enqueue (queue.enqueue_runs): a refused turn no longer moves its
    conversation in the list."""
    tenant = await new_tenant(pool)
    other = await new_conversation(pool, tenant.account_id)
    await enqueue(pool, tenant.account_id, tenant.conversation_id, "first", idempotency_key="k")
    before = await pool.fetchval("SELECT updated_at FROM conversation WHERE id = $1",
                                 tenant.conversation_id)

    async def two(conn: asyncpg.Connection) -> None:
        [written, replayed] = await enqueue_runs(conn, account_id=tenant.account_id, runs=[
            NewRun(other, "written", {"content": "written", "model": "demo"}),
            NewRun(tenant.conversation_id, "replayed", {"content": "replayed", "model": "demo"},
                   "k")])
        assert isinstance(written, EnqueuedRun) and written.created
        assert isinstance(replayed, IdempotencyConflict)

    assert await _updates_in(dsn, two) == _only(conversation=1)
    assert await pool.fetchval("SELECT updated_at FROM conversation WHERE id = $1",
                               tenant.conversation_id) == before
