"""Races of the conversation life cycle, on independent connections released together:
cancelling one queued turn against the claim that would start it, and deleting a conversation
against the worker still writing its turn, the claimer, and a device attaching to it.
"""

from __future__ import annotations

from uuid import UUID

import asyncpg

from agentd.accounts import Principal
from agentd.queue import (
    Claim,
    LeaseLost,
    NewEvent,
    StopResult,
    append_events,
    claim_runs,
    delete_conversation,
    finish_run,
    heartbeat,
    insert_message,
    stop_conversation,
)
from agentd.service import Service
from agentd.settings import Settings
from agentd.tools import ToolContext
from agentd.tools.notes import StaleFence, append_note
from agentd.tools.store import DatabaseToolStore
from agentd.vocabulary import EventType, MessageRole, MessageStatus, RunStatus
from tests.integration.helpers import (
    claim_after_round_trips,
    connections,
    race,
    raise_unexpected,
)
from tests.support.factories import enqueue, new_conversation, new_tenant
from tests.support.journal import assert_journal_sound, read_journal, run_row

LONG_S = 60.0
RACE_ITERATIONS = 150

LEFT_BEHIND = """
SELECT (SELECT count(*) FROM conversation WHERE id = $1)
     + (SELECT count(*) FROM message WHERE conversation_id = $1)
     + (SELECT count(*) FROM agent_run WHERE conversation_id = $1)
     + (SELECT count(*) FROM run_event WHERE run_id = ANY ($2::uuid[]))
     + (SELECT count(*) FROM conversation_lease WHERE conversation_id = $1)
     + (SELECT count(*) FROM presence WHERE conversation_id = $1)
     + (SELECT count(*) FROM conversation_note WHERE conversation_id = $1)
     + (SELECT count(*) FROM conversation_note_fence WHERE conversation_id = $1)
"""


async def test_cancelling_one_queued_turn_racing_its_claim_ends_it_exactly_one_way(
        dsn: str) -> None:
    outcomes = {"cancelled before it ran": 0, "claimed, then asked to stop": 0}
    async with connections(dsn, 3) as (setup, canceller, claimer):
        tenant = await new_tenant(setup)
        for iteration in range(RACE_ITERATIONS):
            context = f"iteration {iteration}"
            conv = await new_conversation(setup, tenant.account_id)
            words = f"my words, turn {iteration}"
            target = (await enqueue(setup, tenant.account_id, conv, words)).run_id
            behind = (await enqueue(setup, tenant.account_id, conv, "behind it")).run_id
            stopped, claimed = await race(
                lambda conv=conv, target=target: stop_conversation(
                    canceller, account_id=tenant.account_id, conversation_id=conv,
                    run_ids=[target]),
                # The stop takes several round trips, the claim one: set off 0-3 round trips
                # late, the claim lands before, inside and after the stop's transaction.
                lambda trips=iteration % 4: claim_after_round_trips(
                    claimer, trips, worker_id="claimer", lease_ttl_s=LONG_S, limit=2))
            raise_unexpected([stopped, claimed], context=context)
            assert isinstance(stopped, StopResult)
            claims: list[Claim] = list(claimed)
            claimed_ids = [c.run_id for c in claims]
            target_row = await run_row(setup, target)
            if target in claimed_ids:
                # The claim won: the target runs, and the cancel became a stop request.
                assert claimed_ids == [target], context  # FIFO: nothing passes a running turn
                assert stopped == StopResult(cancelled=[], drafts=[], flagged=[target]), context
                assert target_row["status"] == RunStatus.RUNNING, context
                assert target_row["cancel_requested"], context
                outcomes["claimed, then asked to stop"] += 1
            else:
                # The cancel won: the turn never started and its words came back, once; the
                # claimer may only have taken the turn behind it, which is now the oldest.
                assert claimed_ids in ([], [behind]), context
                assert stopped.cancelled == [target] and stopped.flagged == [], context
                [draft] = stopped.drafts
                assert (draft.run_id, draft.content) == (target, words), context
                assert target_row["status"] == RunStatus.CANCELLED, context
                assert target_row["claim_token"] is None, context
                message = await setup.fetchrow("SELECT status FROM message WHERE id = $1",
                                               draft.message_id)
                assert message["status"] == MessageStatus.DRAFT, context
                events = await read_journal(setup, target)
                assert EventType.RUN_STARTED not in [e["type"] for e in events], context
                assert events[-1]["payload"]["draft"]["content"] == words, context
                outcomes["cancelled before it ran"] += 1
            await assert_journal_sound(setup, target)
            # Only the one turn was touched: the one behind it was never cancelled and runs
            # (now, or right after the target).
            for claim in claims:
                await finish_run(setup, claim, RunStatus.CANCELLED, seq=claim.last_seq + 1)
            behind_row = await run_row(setup, behind)
            assert not behind_row["cancel_requested"], context
            if behind not in claimed_ids:
                assert behind_row["status"] == RunStatus.QUEUED, context
                [next_claim] = await claim_runs(setup, worker_id="next", lease_ttl_s=LONG_S)
                assert next_claim.run_id == behind, context
                await finish_run(setup, next_claim, RunStatus.COMPLETED,
                                 seq=next_claim.last_seq + 1)
    assert min(outcomes.values()) > 0, outcomes


async def test_delete_racing_the_worker_the_claimer_and_an_attaching_device_leaves_nothing(
        dsn: str) -> None:
    """A worker mid-turn writes its journal, a message, a heartbeat and a note (the notes tool,
    fenced downstream); a claimer takes the next turn; a device attaches; the user deletes.
    Whatever the order, every write either landed before the delete or is refused (LeaseLost;
    the note as a tool error) — never a foreign-key error or a deadlock — the attach answers
    "gone" instead of failing, and nothing of the conversation is left."""
    refused = landed = 0  # iterations where a write lost to the delete / beat it
    async with connections(dsn, 8) as (setup, deleter, appender, writer, beater, claimer,
                                        attacher, noter):
        tenant = await new_tenant(setup)
        device = await setup.fetchval(
            "INSERT INTO device (account_id, name, token_hash) VALUES ($1, 'phone', $2)"
            " RETURNING id", tenant.account_id, b"hash-for-the-race")
        service = Service(attacher, None, Settings(), set())  # type: ignore[arg-type]
        who = Principal(tenant.account_id, "acct", device, "phone")
        for iteration in range(RACE_ITERATIONS):
            context = f"iteration {iteration}"
            conv = await new_conversation(setup, tenant.account_id)
            runs = [(await enqueue(setup, tenant.account_id, conv, f"turn {i}")).run_id
                    for i in range(3)]
            [current] = await claim_runs(setup, worker_id="worker", lease_ttl_s=LONG_S)
            # Written while its turn held the conversation: a mark to delete.
            await append_note(ToolContext(current.run_id, conv, tenant.account_id,
                                          current.fence, DatabaseToolStore(setup)),
                              "a mark to delete")
            # The first turn just finished: the second is claimable while the delete runs.
            await finish_run(setup, current, RunStatus.COMPLETED, seq=current.last_seq + 1,
                             content="done")
            [streaming] = await claim_runs(setup, worker_id="worker", lease_ttl_s=LONG_S)
            tool = ToolContext(streaming.run_id, conv, tenant.account_id, streaming.fence,
                               DatabaseToolStore(noter))
            deleted, appended, written, beaten, claimed, attached, noted = await race(
                lambda conv=conv: delete_conversation(deleter, account_id=tenant.account_id,
                                                      conversation_id=conv),
                lambda s=streaming: append_events(appender, s, [NewEvent(
                    s.last_seq + 1, EventType.CONTENT_DELTA, {"delta": "tok"})]),
                lambda s=streaming: insert_message(writer, s, role=MessageRole.TOOL,
                                                   content="{}", tool_call_id="call-1"),
                lambda s=streaming: heartbeat(beater, s, LONG_S),
                lambda: claim_runs(claimer, worker_id="claimer", lease_ttl_s=LONG_S),
                lambda conv=conv: service.attach(who, conv, 30.0),
                lambda tool=tool: append_note(tool, "written while deleting"))
            raise_unexpected([deleted, appended, written, beaten, claimed, attached, noted],
                             LeaseLost, StaleFence, context=context)
            assert deleted is True, context
            assert claimed == [], context  # the streaming turn holds the conversation
            writes = (appended, written, beaten)
            assert not isinstance(noted, StaleFence) or "no longer holds its turn" in str(noted)
            refused += any(isinstance(r, LeaseLost) for r in writes)
            landed += any(not isinstance(r, LeaseLost) for r in writes)
            assert attached is None or isinstance(attached, UUID), context
            assert await setup.fetchval(LEFT_BEHIND, conv, runs) == 0, context
            # After the delete, every write of the old execution is refused the same way.
            for write in (lambda s=streaming: heartbeat(setup, s, LONG_S),
                          lambda s=streaming: finish_run(setup, s, RunStatus.COMPLETED,
                                                         seq=None, content="late")):
                try:
                    await write()
                except LeaseLost:
                    continue
                raise AssertionError(f"{context}: a write after the delete succeeded")
            assert await delete_conversation(deleter, account_id=tenant.account_id,
                                             conversation_id=conv) is False, context
    assert refused > 0 and landed > 0, (refused, landed)  # both orders were provoked


async def test_a_delete_by_another_account_changes_nothing(pool: asyncpg.Pool) -> None:
    owner = await new_tenant(pool)
    intruder = await new_tenant(pool)
    await enqueue(pool, owner.account_id, owner.conversation_id, "mine")
    await claim_runs(pool, worker_id="worker", lease_ttl_s=LONG_S)
    before = await pool.fetch("SELECT * FROM agent_run ORDER BY id")
    assert await delete_conversation(pool, account_id=intruder.account_id,
                                     conversation_id=owner.conversation_id) is False
    assert await pool.fetch("SELECT * FROM agent_run ORDER BY id") == before
    assert await pool.fetchval("SELECT count(*) FROM conversation WHERE id = $1",
                               owner.conversation_id) == 1
