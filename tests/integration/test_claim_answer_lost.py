"""A claim that commits but whose answer is lost on the wire (the link breaks after the commit,
as when PostgreSQL restarts or a proxy drops the connection). The claimer finds the runs it
took by the claim's key (sql/023) and holds them as if the answer had come; before, they stayed
running with nobody executing them until the reaper failed them (`lease_expired`).

The answer is really lost: the statement runs through a relay (tests/support/lost_answers.py)
that withholds the server's answer and breaks the link once the server has committed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from agentd import db as dbmod
from agentd.queue import claim_runs, finish_run
from agentd.vocabulary import RunStatus
from tests.support.factories import enqueue, new_tenant
from tests.support.lost_answers import AnswerCutter

WORKER = "lost-claim-answer-worker"


@pytest.fixture
async def cut_pool(dsn: str) -> AsyncIterator[tuple[AnswerCutter, asyncpg.Pool]]:
    """A pool whose one session goes through the relay, and the relay."""
    async with AnswerCutter(dsn) as cutter:
        pool = await dbmod.create_pool(cutter.dsn, min_size=1, max_size=1)
        try:
            yield cutter, pool
        finally:
            await pool.close()


async def test_a_claim_whose_answer_was_lost_holds_the_runs_it_committed(
        pool: asyncpg.Pool, cut_pool: tuple[AnswerCutter, asyncpg.Pool]) -> None:
    cutter, through = cut_pool
    tenant = await new_tenant(pool)
    runs = [await enqueue(pool, tenant.account_id, tenant.conversation_id, "go")]
    cutter.cut(WORKER.encode())

    claims = await claim_runs(through, worker_id=WORKER, lease_ttl_s=30, limit=5)

    assert cutter.cut_done.is_set(), "the relay never cut the claim's answer"
    assert [c.run_id for c in claims] == [r.run_id for r in runs]
    [claim] = claims
    row = await pool.fetchrow("SELECT status, claim_token, fence, worker_id FROM agent_run"
                              " WHERE id = $1", claim.run_id)
    assert (row["status"], row["claim_token"], row["fence"], row["worker_id"]) == (
        RunStatus.RUNNING, claim.claim_token, claim.fence, WORKER)
    started = await pool.fetchval("SELECT seq FROM run_event WHERE run_id = $1"
                                  " AND type = 'run_started'", claim.run_id)
    assert claim.last_seq == started
    # What was found is held: its fenced writes go through.
    await finish_run(pool, claim, RunStatus.COMPLETED, seq=claim.last_seq + 1, content="done")
    assert await pool.fetchval("SELECT status FROM agent_run WHERE id = $1",
                               claim.run_id) == RunStatus.COMPLETED


async def test_a_claim_of_several_runs_finds_them_all_and_nothing_else(
        pool: asyncpg.Pool, cut_pool: tuple[AnswerCutter, asyncpg.Pool]) -> None:
    cutter, through = cut_pool
    tenants = [await new_tenant(pool) for _ in range(4)]
    runs = [await enqueue(pool, t.account_id, t.conversation_id, "go") for t in tenants]
    # Another claim of the same worker name, whose answer came: not the lost claim's.
    [other] = await claim_runs(pool, worker_id=WORKER, lease_ttl_s=30, limit=1)
    cutter.cut(WORKER.encode())

    claims = await claim_runs(through, worker_id=WORKER, lease_ttl_s=30, limit=10)

    assert cutter.cut_done.is_set()
    assert other.run_id not in {c.run_id for c in claims}
    assert sorted(c.run_id for c in claims) == sorted(
        r.run_id for r in runs if r.run_id != other.run_id)
    tokens = dict(await pool.fetch("SELECT id, claim_token FROM agent_run WHERE id = ANY($1)",
                                   [c.run_id for c in claims]))
    assert {c.run_id: c.claim_token for c in claims} == tokens


async def test_a_lost_answer_to_a_claim_that_took_nothing_is_raised(
        pool: asyncpg.Pool, cut_pool: tuple[AnswerCutter, asyncpg.Pool]) -> None:
    cutter, through = cut_pool
    cutter.cut(WORKER.encode())
    with pytest.raises(asyncpg.ConnectionDoesNotExistError):
        await claim_runs(through, worker_id=WORKER, lease_ttl_s=30, limit=5)
    assert cutter.cut_done.is_set()
