"""The `notes` tool: downstream fencing (docs/providers.md, "Fenced writes"), against a real
PostgreSQL.

A superseded execution (its lease expired, the run was reaped, a newer run claimed the
conversation with a higher fence) must not write once the newer one did, nor before it did, nor
while its lease has run out unreaped; the current one must.
"""

from __future__ import annotations

import asyncio
from uuid import UUID

import asyncpg
import pytest

from agentd import db as dbmod
from agentd.db import DbTimeouts
from agentd.queue import Claim, claim_runs, reap_expired
from agentd.tools import ToolContext, ToolError, default_tools
from agentd.tools.notes import StaleFence
from agentd.tools.store import DatabaseToolStore, StoreUnavailable
from tests.integration.helpers import race, wait_lease_expired
from tests.support.daemon import poll_until
from tests.support.factories import enqueue, new_tenant

WORKER = "notes-test-worker"


async def _notes(pool: asyncpg.Pool, conversation_id: UUID) -> list[asyncpg.Record]:
    return await pool.fetch("SELECT id, run_id, fence, text FROM conversation_note"
                            " WHERE conversation_id = $1 ORDER BY id", conversation_id)


async def _superseded_and_current(pool: asyncpg.Pool) -> tuple[ToolContext, ToolContext]:
    """Run A claimed, its lease expired and reaped; run B then claimed the conversation."""
    tenant = await new_tenant(pool)
    run_a = await enqueue(pool, tenant.account_id, tenant.conversation_id, "first")
    [claim_a] = await claim_runs(pool, worker_id=WORKER, lease_ttl_s=0.2)
    assert claim_a.run_id == run_a.run_id
    await wait_lease_expired(pool, claim_a.run_id)
    assert claim_a.run_id in await reap_expired(pool, grace_s=0, limit=10)
    run_b = await enqueue(pool, tenant.account_id, tenant.conversation_id, "second")
    [claim_b] = await claim_runs(pool, worker_id=WORKER, lease_ttl_s=30)
    assert claim_b.run_id == run_b.run_id and claim_b.fence > claim_a.fence

    def context(claim: Claim) -> ToolContext:
        return ToolContext(claim.run_id, claim.conversation_id, claim.account_id, claim.fence,
                           DatabaseToolStore(pool))

    return context(claim_a), context(claim_b)


async def test_notes_write_from_a_superseded_run_is_rejected_and_writes_nothing(
        pool: asyncpg.Pool) -> None:
    zombie, current = await _superseded_and_current(pool)
    tools = default_tools()

    accepted = await tools.call("notes", {"action": "append", "text": "from B"}, current)
    assert accepted["note_id"] > 0
    before = await _notes(pool, current.conversation_id)

    with pytest.raises(StaleFence, match=f"fence {zombie.fence} is lower than "
                                         f"{current.fence}.*nothing written"):
        await tools.call("notes", {"action": "append", "text": "from zombie A"}, zombie)
    assert await _notes(pool, current.conversation_id) == before
    mark = await pool.fetchval("SELECT fence FROM conversation_note_fence"
                               " WHERE conversation_id = $1", current.conversation_id)
    assert mark == current.fence, "a rejected write must not move the high-water mark"

    # The current run keeps writing (equal fence), and reads see only accepted notes.
    await tools.call("notes", {"action": "append", "text": "from B again"}, current)
    rows = await _notes(pool, current.conversation_id)
    assert [(r["text"], r["fence"], r["run_id"]) for r in rows] == [
        ("from B", current.fence, current.run_id),
        ("from B again", current.fence, current.run_id)]
    listed = await tools.call("notes", {"action": "list"}, zombie)  # reads are not fenced
    assert [n["text"] for n in listed["notes"]] == ["from B", "from B again"]


async def test_racing_fenced_writers_never_land_an_older_fence_after_a_newer_one(
        pool: asyncpg.Pool) -> None:
    _, newer = await _superseded_and_current(pool)
    tools = default_tools()
    store = DatabaseToolStore(pool)
    rejected = 0
    for round_no in range(1, 31):
        # Both writers on the live run, so that only the mark tells them apart.
        low = ToolContext(newer.run_id, newer.conversation_id, newer.account_id,
                          10 * round_no + 1, store)
        high = ToolContext(newer.run_id, newer.conversation_id, newer.account_id,
                           10 * round_no + 2, store)
        results = await race(
            lambda low=low: tools.call("notes", {"action": "append", "text": "low"}, low),
            lambda high=high: tools.call("notes", {"action": "append", "text": "high"}, high))
        assert not isinstance(results[1], BaseException), results[1]
        if isinstance(results[0], BaseException):
            assert isinstance(results[0], StaleFence), results[0]
            rejected += 1
    rows = await _notes(pool, newer.conversation_id)
    fences = [r["fence"] for r in rows]
    assert fences == sorted(fences), "an older fence landed after a newer one"
    assert len(rows) == 60 - rejected
    assert {r["fence"] for r in rows if r["text"] == "high"} == {
        10 * n + 2 for n in range(1, 31)}


async def test_a_superseded_run_cannot_write_before_its_successor_did(
        pool: asyncpg.Pool) -> None:
    """The mark alone knows only fences it has seen: here the successor has written nothing."""
    zombie, current = await _superseded_and_current(pool)
    tools = default_tools()
    with pytest.raises(StaleFence, match=r"no longer holds its turn.*nothing written"):
        await tools.call("notes", {"action": "append", "text": "from zombie A"}, zombie)
    assert await _notes(pool, current.conversation_id) == []
    assert await pool.fetchval("SELECT count(*) FROM conversation_note_fence"
                               " WHERE conversation_id = $1", current.conversation_id) == 0
    await tools.call("notes", {"action": "append", "text": "from B"}, current)
    assert [r["text"] for r in await _notes(pool, current.conversation_id)] == ["from B"]


async def test_a_run_whose_lease_ran_out_cannot_write_before_it_is_reaped(
        pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    await enqueue(pool, tenant.account_id, tenant.conversation_id, "first")
    [claim] = await claim_runs(pool, worker_id=WORKER, lease_ttl_s=30)
    paused = ToolContext(claim.run_id, claim.conversation_id, claim.account_id, claim.fence,
                         DatabaseToolStore(pool))
    tools = default_tools()
    await tools.call("notes", {"action": "append", "text": "while live"}, paused)
    # The execution pauses past its lease (a frozen VM): the lease runs out unrenewed.
    await pool.execute("UPDATE agent_run SET lease_expires_at = clock_timestamp()"
                       " WHERE id = $1", claim.run_id)
    with pytest.raises(StaleFence, match="no longer holds its turn"):
        await tools.call("notes", {"action": "append", "text": "after the lease"}, paused)
    assert [r["text"] for r in await _notes(pool, tenant.conversation_id)] == ["while live"]
    assert await pool.fetchval("SELECT status FROM agent_run WHERE id = $1",
                               claim.run_id) == "running", "the test meant an unreaped run"


async def test_a_note_the_database_does_not_answer_is_a_tool_error_not_a_failed_turn(
        pool: asyncpg.Pool, dsn: str) -> None:
    """The model reads what became of its write and the turn goes on: nothing written when the
    server refused the statement, in doubt when the connection broke while it was out."""
    _, current = await _superseded_and_current(pool)
    await default_tools().call("notes", {"action": "append", "text": "before"}, current)
    tools = default_tools()
    # The tool's own one-connection pool, with a lock wait short enough for a test.
    own = await dbmod.create_pool(dsn, min_size=1, max_size=1, application_name="notes-tool",
                                  timeouts=DbTimeouts(lock_timeout_ms=300))
    ctx = ToolContext(current.run_id, current.conversation_id, current.account_id,
                      current.fence, DatabaseToolStore(own))
    holder = await asyncpg.connect(dsn)
    try:
        # Another transaction holds the notebook's mark row: the append waits on it.
        lock = holder.transaction()
        await lock.start()
        await holder.execute("SELECT 1 FROM conversation_note_fence WHERE conversation_id = $1"
                             " FOR UPDATE", current.conversation_id)
        with pytest.raises(StoreUnavailable, match="nothing written, try again"):
            await tools.call("notes", {"action": "append", "text": "refused"}, ctx)

        # The connection breaks while the statement waits: its fate is unknown to the tool.
        await own.execute("SET lock_timeout = 0")
        append = asyncio.ensure_future(
            tools.call("notes", {"action": "append", "text": "in doubt"}, ctx))
        waiting = await poll_until(lambda: pool.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'notes-tool'"
            " AND wait_event_type = 'Lock'"), 10, what="the append's lock wait")
        await pool.execute("SELECT pg_terminate_backend($1)", waiting)
        with pytest.raises(StoreUnavailable, match=r"may or may not have been written.*read back"):
            await append
        await lock.rollback()

        # The pool opens a new connection; reads and writes work again.
        listed = await tools.call("notes", {"action": "list"}, ctx)
        assert [n["text"] for n in listed["notes"]] == ["before"]
        await tools.call("notes", {"action": "append", "text": "after"}, ctx)
        assert [r["text"] for r in await _notes(pool, current.conversation_id)] == [
            "before", "after"]
    finally:
        await holder.close()
        await own.close()


async def test_notes_arguments_are_checked(pool: asyncpg.Pool) -> None:
    _, current = await _superseded_and_current(pool)
    tools = default_tools()
    with pytest.raises(ToolError, match="non-empty 'text'"):
        await tools.call("notes", {"action": "append", "text": "   "}, current)
    with pytest.raises(ToolError, match="limit must be between"):
        await tools.call("notes", {"action": "list", "limit": 0}, current)
    assert await _notes(pool, current.conversation_id) == []
