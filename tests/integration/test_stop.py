"""Stop is one transaction: queued turns are cancelled (their text handed back as drafts), the
running turn is flagged and woken, and nothing that was queued starts after the stop commits."""

from __future__ import annotations

import asyncpg

from agentd.queue import (
    Claim,
    StopResult,
    claim_runs,
    finish_run,
    heartbeat,
    stop_conversation,
)
from agentd.vocabulary import Channel, EventType, MessageStatus, RunStatus
from tests.integration.helpers import (
    claim_after_round_trips,
    connections,
    count_rows,
    listening,
    race,
    raise_unexpected,
)
from tests.support.factories import enqueue, new_conversation, new_tenant
from tests.support.journal import assert_journal_sound, read_journal, run_row

LONG_S = 60.0
RACE_ITERATIONS = 200

CONVERSATION_RUNS = """
SELECT id, status, cancel_requested FROM agent_run WHERE conversation_id = $1
ORDER BY created_at, id
"""


async def test_stop_cancels_queued_turns_with_drafts_and_flags_the_running_turn(
        dsn: str, pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    conv = tenant.conversation_id
    await enqueue(pool, tenant.account_id, conv, "first")
    second = await enqueue(pool, tenant.account_id, conv, "second, with more to say")
    third = await enqueue(pool, tenant.account_id, conv, "third")
    [running] = await claim_runs(pool, worker_id="worker", lease_ttl_s=LONG_S)
    running_counts = await count_rows(pool, running.run_id)

    async with listening(dsn, Channel.RUN_CANCEL) as cancels, \
            listening(dsn, Channel.CONVERSATION) as feed:
        result = await stop_conversation(pool, account_id=tenant.account_id,
                                         conversation_id=conv)
        assert await cancels.next() == str(running.run_id)
        assert await feed.next() == str(conv)

    assert result.flagged == [running.run_id]
    assert result.cancelled == [second.run_id, third.run_id]
    assert [(d.run_id, d.content) for d in result.drafts] == [
        (second.run_id, "second, with more to say"), (third.run_id, "third")]

    for queued in (second, third):
        run = await run_row(pool, queued.run_id)
        assert run["status"] == RunStatus.CANCELLED and run["finished_at"] is not None
        assert run["claim_token"] is None  # it never started
        draft = next(d for d in result.drafts if d.run_id == queued.run_id)
        message = await pool.fetchrow("SELECT * FROM message WHERE id = $1", draft.message_id)
        assert message["id"] == run["user_message_id"]
        assert (message["status"], message["content"]) == (MessageStatus.DRAFT, draft.content)
        events = await assert_journal_sound(pool, queued.run_id)
        assert [(e["seq"], e["type"]) for e in events][-1] == (3, EventType.COMPLETE)
        assert events[-1]["payload"]["status"] == RunStatus.CANCELLED
        # The stream hands the draft back too, so every device can return it to its author.
        assert events[-1]["payload"]["draft"] == {"message_id": str(draft.message_id),
                                                  "content": draft.content}

    # The running turn is only asked to stop: still running, no ending journaled for it.
    run = await run_row(pool, running.run_id)
    assert run["status"] == RunStatus.RUNNING and run["cancel_requested"]
    assert await count_rows(pool, running.run_id) == running_counts
    # The heartbeat is the missed-NOTIFY path: the worker learns of the stop from it too.
    assert (await heartbeat(pool, running, LONG_S)).cancel_requested
    assert await claim_runs(pool, worker_id="other", lease_ttl_s=LONG_S, limit=10) == []

    # The worker finalizes cancelled and keeps its partial answer.
    message_id = await finish_run(pool, running, RunStatus.CANCELLED, seq=running.last_seq + 1,
                                  content="half an ans", message_status=MessageStatus.PARTIAL)
    answer = await pool.fetchrow("SELECT * FROM message WHERE id = $1", message_id)
    assert (answer["content"], answer["status"]) == ("half an ans", MessageStatus.PARTIAL)
    assert (await read_journal(pool, running.run_id))[-1]["payload"] == {
        "status": "cancelled", "error": None, "error_code": None,
        "message_id": str(message_id), "usage": None}


async def test_stop_hands_drafts_back_in_the_order_they_were_queued(pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    conv = tenant.conversation_id
    queued = [await enqueue(pool, tenant.account_id, conv, f"turn {n}") for n in range(12)]
    # The statement orders them: ids are random, so an index on them would not.
    result = await stop_conversation(pool, account_id=tenant.account_id, conversation_id=conv)
    assert result.cancelled == [turn.run_id for turn in queued]
    assert [d.content for d in result.drafts] == [f"turn {n}" for n in range(12)]


async def test_stop_by_another_account_changes_nothing(pool: asyncpg.Pool) -> None:
    owner = await new_tenant(pool)
    intruder = await new_tenant(pool)
    await enqueue(pool, owner.account_id, owner.conversation_id, "first")
    await enqueue(pool, owner.account_id, owner.conversation_id, "second")
    await claim_runs(pool, worker_id="worker", lease_ttl_s=LONG_S)
    before = await pool.fetch("SELECT * FROM agent_run ORDER BY id")

    result = await stop_conversation(pool, account_id=intruder.account_id,
                                     conversation_id=owner.conversation_id)
    assert result == StopResult(cancelled=[], drafts=[], flagged=[])
    assert await pool.fetch("SELECT * FROM agent_run ORDER BY id") == before


def assert_stopped(rows: list[asyncpg.Record], context: str) -> None:
    """After a stop: nothing queued; a turn still running is one the stop flagged."""
    for row in rows:
        assert row["status"] != RunStatus.QUEUED, f"{context}: a turn outlived the stop queued"
        if row["status"] == RunStatus.RUNNING:
            assert row["cancel_requested"], f"{context}: a turn started after the stop"


async def test_stop_racing_claims_never_lets_a_queued_turn_start_after_the_stop(
        dsn: str) -> None:
    outcomes = {"claim first": 0, "stop first": 0}
    async with connections(dsn, 4) as (setup, stopper, *claimers):
        tenant = await new_tenant(setup)
        for iteration in range(RACE_ITERATIONS):
            conv = await new_conversation(setup, tenant.account_id)
            runs = [(await enqueue(setup, tenant.account_id, conv, f"turn {i}")).run_id
                    for i in range(3)]
            # The claim is one round trip, the stop several: claimers set off 0-3 round trips
            # late, so claims land before, inside and after the stop's transaction.
            stop, *claimed = await race(
                lambda conv=conv: stop_conversation(stopper, account_id=tenant.account_id,
                                                    conversation_id=conv),
                *(lambda conn=conn, i=i, trips=(iteration + i) % 4: claim_after_round_trips(
                    conn, trips, worker_id=f"claimer-{i}", lease_ttl_s=LONG_S, limit=2)
                  for i, conn in enumerate(claimers)))
            context = f"iteration {iteration}"
            raise_unexpected([stop, *claimed], context=context)
            claims: list[Claim] = [c for result in claimed for c in result]
            assert len(claims) <= 1, context
            if claims:
                # The claim won: its turn is the oldest, and the stop flagged it.
                assert claims[0].run_id == runs[0], context
                assert stop.flagged == [runs[0]] and stop.cancelled == runs[1:], context
            else:
                assert stop.flagged == [] and stop.cancelled == runs, context
            outcomes["claim first" if claims else "stop first"] += 1

            assert_stopped(await setup.fetch(CONVERSATION_RUNS, conv), context)
            assert await claim_runs(setup, worker_id="late", lease_ttl_s=LONG_S) == [], context
            for run_id in runs:
                await assert_journal_sound(setup, run_id)
            for claim in claims:
                await finish_run(setup, claim, RunStatus.CANCELLED, seq=claim.last_seq + 1)
    assert min(outcomes.values()) > 0, outcomes


async def test_stop_racing_finish_never_orphans_or_double_ends_a_turn(dsn: str) -> None:
    async with connections(dsn, 4) as (setup, worker, stopper, claimer):
        tenant = await new_tenant(setup)
        for iteration in range(RACE_ITERATIONS):
            conv = await new_conversation(setup, tenant.account_id)
            runs = [(await enqueue(setup, tenant.account_id, conv, f"turn {i}")).run_id
                    for i in range(3)]
            [current] = await claim_runs(worker, worker_id="worker", lease_ttl_s=LONG_S)
            # The worker finishes (and knocks) while the user stops and a claimer answers the
            # knock: whatever the order, every turn ends once and none is left queued.
            finished, stop, claimed = await race(
                lambda current=current: finish_run(worker, current, RunStatus.COMPLETED,
                                                   seq=current.last_seq + 1,
                                                   content="answer"),
                lambda conv=conv: stop_conversation(stopper, account_id=tenant.account_id,
                                                    conversation_id=conv),
                lambda: claim_runs(claimer, worker_id="claimer", lease_ttl_s=LONG_S))
            context = f"iteration {iteration}"
            raise_unexpected([finished, stop, claimed], context=context)
            assert (await run_row(setup, current.run_id))["status"] == RunStatus.COMPLETED
            for claim in claimed:
                assert claim.run_id == runs[1], context
                assert stop.flagged == [claim.run_id], context
            assert set(stop.cancelled) | {c.run_id for c in claimed} == set(runs[1:]), context

            assert_stopped(await setup.fetch(CONVERSATION_RUNS, conv), context)
            for run_id in runs:
                events = await assert_journal_sound(setup, run_id)
                status = (await run_row(setup, run_id))["status"]
                ended = [e for e in events if e["type"] == EventType.COMPLETE]
                assert len(ended) == (1 if RunStatus(status).terminal else 0), context
            for claim in claimed:
                await finish_run(setup, claim, RunStatus.CANCELLED, seq=claim.last_seq + 1)

