"""Concurrent claimers on independent sessions: each run at most once, one turn per conversation.

A model of the queue (per-conversation FIFO, at most one running turn) predicts every round's
claims; the database is checked against the invariants after every round.
"""

from __future__ import annotations

import random
from collections import deque
from uuid import UUID

import asyncpg
import pytest

from agentd.queue import Claim, claim_runs, finish_run, lost_race
from agentd.vocabulary import RunStatus
from tests.integration.helpers import connections, race, raise_unexpected
from tests.support.factories import enqueue, new_conversation, new_tenant
from tests.support.journal import run_row
from tests.support.races import (
    DEADLOCK,
    MULTIXACT,
    OTHER_INTERNAL,
    lose_races,
    race_attempts,
)

WORKERS = 4
# Four conversations: a turn runs for two rounds on average and the next starts the round it ends
# or the one after, so each round claims between 4/3 and 2 turns however the races fall, and the
# model is exercised beyond ITERATIONS turns (with three, a loaded machine claimed 496 in 500).
# Never more than the four claimers' smallest total batch, so every idle conversation's turn fits.
CONVERSATIONS = 4
ITERATIONS = 500
LEASE_S = 60.0

# Every invariant of the queue, as rows that must not exist.
VIOLATIONS = """
SELECT
  (SELECT count(*) FROM (SELECT conversation_id FROM agent_run WHERE status = 'running'
                         GROUP BY conversation_id HAVING count(*) > 1) AS c)
      AS conversations_running_twice,
  (SELECT count(*) FROM agent_run r
   WHERE r.started_at IS NOT NULL AND EXISTS (
       SELECT 1 FROM agent_run older
       WHERE older.conversation_id = r.conversation_id AND older.status = 'queued'
         AND (older.created_at, older.id) < (r.created_at, r.id)))
      AS started_ahead_of_an_older_turn,
  (SELECT count(*) FROM agent_run r
   WHERE r.status = 'running' AND NOT EXISTS (
       SELECT 1 FROM conversation_lease l
       WHERE l.conversation_id = r.conversation_id AND l.run_id = r.id
         AND l.execution_id = r.claim_token AND l.fence = r.fence))
      AS running_without_its_lease,
  (SELECT count(*) FROM conversation_lease l
   WHERE NOT EXISTS (SELECT 1 FROM agent_run r
                     WHERE r.id = l.run_id AND r.status = 'running'))
      AS leases_of_idle_conversations
"""


async def assert_no_violations(db: asyncpg.Connection, context: str) -> None:
    row = await db.fetchrow(VIOLATIONS)
    assert all(v == 0 for v in row.values()), f"{context}: {dict(row)}"


async def test_concurrent_claimers_never_double_claim_and_keep_one_turn_per_conversation(
        dsn: str) -> None:
    """Claimers race (some batch-claiming) while a worker finishes turns, round after round.

    Each round must claim exactly the oldest queued turn of every idle conversation (unrelated
    conversations never block one another) and nothing else; a conversation whose running turn
    finishes during the round may or may not have its next turn claimed in that round.
    """
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    async with connections(dsn, WORKERS + 2) as conns:
        setup, finisher, workers = conns[0], conns[1], conns[2:]
        tenant = await new_tenant(setup)
        convs = [tenant.conversation_id] + [
            await new_conversation(setup, tenant.account_id) for _ in range(CONVERSATIONS - 1)]
        queued: dict[UUID, deque[UUID]] = {c: deque() for c in convs}
        running: dict[UUID, Claim] = {}
        ever_claimed: set[UUID] = set()

        for iteration in range(ITERATIONS + 1_000):
            draining = iteration >= ITERATIONS
            if draining and not running and not any(queued.values()):
                break
            context = f"seed {seed}, iteration {iteration}"
            # New turns arrive, the conversations' turns interleaved in the queue's order.
            turns = [] if draining else [
                c for c in convs for _ in range(rng.randint(0, 2)) if len(queued[c]) < 3]
            rng.shuffle(turns)
            async with setup.transaction():
                for conv in turns:
                    run = await enqueue(setup, tenant.account_id, conv, f"turn {iteration}")
                    queued[conv].append(run.run_id)

            # Some running turns end during the round, racing the claimers.
            ending = [c for c in running if rng.random() < 0.5]
            mandatory = {queued[c][0] for c in convs if c not in running and queued[c]}
            optional = {queued[c][0] for c in ending if queued[c]}
            limits = [rng.choice((1, 1, 3)) for _ in workers]
            actions = [
                lambda conn=conn, i=i, limit=limit: claim_runs(
                    conn, worker_id=f"worker-{i}", lease_ttl_s=LEASE_S, limit=limit)
                for i, (conn, limit) in enumerate(zip(workers, limits, strict=True))]
            endings = [running[c] for c in ending]
            if endings:
                actions.append(lambda claims=endings: _finish_all(finisher, claims))
            results = await race(*actions)
            raise_unexpected(results, context=context)

            claims = [claim for result in results[:WORKERS] for claim in result]
            claimed = [c.run_id for c in claims]
            assert len(claimed) == len(set(claimed)), f"{context}: a run claimed twice"
            assert not ever_claimed & set(claimed), f"{context}: a run claimed again"
            ever_claimed.update(claimed)
            assert mandatory <= set(claimed) <= mandatory | optional, (
                f"{context}: claimed {claimed}, expected {mandatory} (+ maybe {optional})")
            by_conv = [c.conversation_id for c in claims]
            assert len(by_conv) == len(set(by_conv)), f"{context}: two turns of one conv"

            for conv in ending:
                del running[conv]
            for claim in claims:
                assert queued[claim.conversation_id][0] == claim.run_id, context
                queued[claim.conversation_id].popleft()
                assert claim.conversation_id not in running, context
                running[claim.conversation_id] = claim
            await assert_no_violations(setup, context)
        else:
            raise AssertionError("the queue never drained")

        # The model was exercised, not vacuous: many turns ran, all of them exactly once.
        assert len(ever_claimed) > ITERATIONS
        assert await setup.fetchval(
            "SELECT count(*) FROM agent_run WHERE status <> 'completed'") == 0


async def _finish_all(conn: asyncpg.Connection, claims: list[Claim]) -> None:
    for claim in claims:
        await finish_run(conn, claim, RunStatus.COMPLETED, seq=claim.last_seq + 1,
                         content="done")


async def test_batch_claim_takes_at_most_one_turn_per_conversation(dsn: str) -> None:
    async with connections(dsn, 3) as (setup, first, second):
        tenant = await new_tenant(setup)
        convs = [tenant.conversation_id] + [
            await new_conversation(setup, tenant.account_id) for _ in range(3)]
        busy = convs[-1]
        # One conversation already has a turn running: its queued turns must wait.
        await enqueue(setup, tenant.account_id, busy, "busy")
        [holder] = await claim_runs(setup, worker_id="holder", lease_ttl_s=LEASE_S)
        for iteration in range(60):
            order = [c for c in convs for _ in range(3)]
            random.Random(iteration).shuffle(order)
            heads: dict[UUID, UUID] = {}
            for conv in order:
                run = await enqueue(setup, tenant.account_id, conv, f"turn {iteration}")
                heads.setdefault(conv, run.run_id)

            results = await race(
                lambda: claim_runs(first, worker_id="a", lease_ttl_s=LEASE_S, limit=10),
                lambda: claim_runs(second, worker_id="b", lease_ttl_s=LEASE_S, limit=10))
            raise_unexpected(results)
            claims = [c for result in results for c in result]
            assert sorted(c.run_id for c in claims) == sorted(
                heads[c] for c in convs if c != busy), f"iteration {iteration}"
            await assert_no_violations(setup, f"iteration {iteration}")

            # A batch claim alone, with no rival: still one turn per conversation.
            for claim in claims:
                await finish_run(setup, claim, RunStatus.COMPLETED, seq=claim.last_seq + 1)
            again = await claim_runs(first, worker_id="a", lease_ttl_s=LEASE_S, limit=10)
            assert len({c.conversation_id for c in again}) == len(again) == len(convs) - 1
            assert busy not in {c.conversation_id for c in again}
            await assert_no_violations(setup, f"iteration {iteration}, alone")
            for claim in again:
                await finish_run(setup, claim, RunStatus.COMPLETED, seq=claim.last_seq + 1)
            # Drain the third turns so the next iteration starts from idle conversations.
            rest = await claim_runs(first, worker_id="a", lease_ttl_s=LEASE_S, limit=10)
            assert len(rest) == len(convs) - 1
            for claim in rest:
                await finish_run(setup, claim, RunStatus.COMPLETED, seq=claim.last_seq + 1)
        assert await setup.fetchval("SELECT status FROM agent_run WHERE id = $1",
                                    holder.run_id) == RunStatus.RUNNING
        assert await setup.fetchval(
            "SELECT count(*) FROM agent_run WHERE conversation_id = $1 AND status = 'queued'",
            busy) == 180


async def _queued_turn(pool: asyncpg.Pool) -> tuple[UUID, asyncpg.Record]:
    tenant = await new_tenant(pool)
    turn = await enqueue(pool, tenant.account_id, tenant.conversation_id, "claimed after a race")
    return turn.run_id, await run_row(pool, turn.run_id)


@pytest.mark.parametrize("error", [MULTIXACT, DEADLOCK], ids=["multixact", "deadlock"])
async def test_a_claim_that_loses_a_race_to_other_transactions_runs_again_at_once(
        pool: asyncpg.Pool, error: tuple[str, str]) -> None:
    """A claim that fails as a deadlock's victim or with PostgreSQL's multixact error wrote
    nothing: it runs once more at once and takes the turn, not a tick later."""
    run_id, _ = await _queued_turn(pool)
    await lose_races(pool, times=1, on="UPDATE ON agent_run", error=error)
    claims = await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S)
    assert [c.run_id for c in claims] == [run_id]
    assert await race_attempts(pool) == 2
    assert (await run_row(pool, run_id))["status"] == RunStatus.RUNNING


@pytest.mark.parametrize(("error", "attempts"), [(MULTIXACT, 2), (DEADLOCK, 2),
                                                 (OTHER_INTERNAL, 1)],
                         ids=["multixact", "deadlock", "another-internal-error"])
async def test_a_claim_that_keeps_failing_raises_and_leaves_the_turn_untouched(
        pool: asyncpg.Pool, error: tuple[str, str], attempts: int) -> None:
    """Losing again after its retry, a claim raises (the loop waits for a wake or a tick); a
    failure that is not a lost race is not run again at all."""
    run_id, before = await _queued_turn(pool)
    await lose_races(pool, times=2, on="UPDATE ON agent_run", error=error)
    with pytest.raises(asyncpg.PostgresError) as failed:
        await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S)
    assert lost_race(failed.value) == (attempts == 2)
    assert await race_attempts(pool) == attempts
    assert await run_row(pool, run_id) == before
    assert await pool.fetchval("SELECT count(*) FROM conversation_lease") == 0


async def test_inside_its_callers_transaction_a_lost_claim_is_not_run_again(
        pool: asyncpg.Pool) -> None:
    """The failed statement spoilt the caller's transaction: a second attempt there would fail
    as "current transaction is aborted" and hide what happened."""
    tenant = await new_tenant(pool)
    await enqueue(pool, tenant.account_id, tenant.conversation_id, "inside")
    await lose_races(pool, times=1, on="UPDATE ON agent_run", error=DEADLOCK)
    async with pool.acquire() as conn:
        with pytest.raises(asyncpg.DeadlockDetectedError):
            async with conn.transaction():
                await claim_runs(conn, worker_id="w", lease_ttl_s=LEASE_S)
    assert await race_attempts(pool) == 1
