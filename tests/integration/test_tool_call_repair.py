"""The one tool-call repair (answer_open_tool_calls): whoever ends a turn, every tool call it
left without a result gets exactly one `cancelled` result, before the turn's answer, and only
while the writer still owns the run."""

from __future__ import annotations

from uuid import UUID

import asyncpg
import pytest

from agentd.queue import (
    Claim,
    LeaseLost,
    NewEvent,
    answer_open_tool_calls,
    append_events,
    claim_runs,
    finish_run,
    insert_message,
    reap_expired,
    stop_conversation,
)
from agentd.vocabulary import EventType, MessageRole, MessageStatus, RunStatus
from tests.integration.helpers import wait_lease_expired
from tests.support.factories import enqueue, new_tenant

CALLS = [{"id": "call_a", "name": "calculator", "arguments": {"expression": "1+1"}},
         {"id": "call_b", "name": "clock", "arguments": {}},
         {"id": "call_c", "name": "notes", "arguments": {"action": "list"}}]


async def claim_with_open_calls(pool: asyncpg.Pool, lease_ttl_s: float = 60.0) -> Claim:
    """A running turn that asked for three tools and got the first one's result."""
    tenant = await new_tenant(pool)
    await enqueue(pool, tenant.account_id, tenant.conversation_id, "use tools")
    [claim] = await claim_runs(pool, worker_id="repair-test", lease_ttl_s=lease_ttl_s)
    await insert_message(pool, claim, role=MessageRole.ASSISTANT, content="", tool_calls=CALLS)
    await insert_message(pool, claim, role=MessageRole.TOOL, content='{"result": 2}',
                         tool_call_id="call_a")
    return claim


async def transcript(pool: asyncpg.Pool, run_id: UUID) -> list[tuple[str, str | None, str]]:
    rows = await pool.fetch("SELECT role, tool_call_id, status FROM message WHERE run_id = $1"
                            " ORDER BY position", run_id)
    return [(r["role"], r["tool_call_id"], r["status"]) for r in rows]


ANSWERED = [("user", None, "complete"), ("assistant", None, "complete"),
            ("tool", "call_a", "complete"), ("tool", "call_b", "cancelled"),
            ("tool", "call_c", "cancelled")]


async def test_the_worker_answers_its_open_calls_once_and_only_while_it_owns_the_run(
        pool: asyncpg.Pool) -> None:
    claim = await claim_with_open_calls(pool)
    assert await answer_open_tool_calls(pool, claim) == 2
    assert await answer_open_tool_calls(pool, claim) == 0  # idempotent
    assert await transcript(pool, claim.run_id) == ANSWERED

    expired = await claim_with_open_calls(pool, lease_ttl_s=0.05)
    await wait_lease_expired(pool, expired.run_id)
    with pytest.raises(LeaseLost):
        await answer_open_tool_calls(pool, expired)
    assert [m[1] for m in await transcript(pool, expired.run_id)] == [None, None, "call_a"]


async def test_the_reaper_answers_a_dead_workers_open_calls(pool: asyncpg.Pool) -> None:
    claim = await claim_with_open_calls(pool, lease_ttl_s=0.05)
    await wait_lease_expired(pool, claim.run_id)
    assert await reap_expired(pool) == [claim.run_id]
    assert await transcript(pool, claim.run_id) == ANSWERED


async def test_a_stop_answers_the_open_calls_of_the_turn_it_ends(pool: asyncpg.Pool) -> None:
    claim = await claim_with_open_calls(pool)
    await stop_conversation(pool, account_id=claim.account_id,
                            conversation_id=claim.conversation_id)
    # The stop only flags a running turn; its worker's terminal write does the repair.
    assert [m[1] for m in await transcript(pool, claim.run_id)] == [None, None, "call_a"]
    await finish_run(pool, claim, RunStatus.CANCELLED, seq=None)
    assert await transcript(pool, claim.run_id) == ANSWERED


async def test_the_terminal_write_answers_open_calls_before_the_answer(
        pool: asyncpg.Pool) -> None:
    claim = await claim_with_open_calls(pool)
    message_id = await finish_run(pool, claim, RunStatus.CANCELLED, seq=None,
                                  content="partial text", message_status=MessageStatus.PARTIAL)
    assert message_id is not None
    assert await transcript(pool, claim.run_id) == [*ANSWERED,
                                                    ("assistant", None, "partial")]


async def stream_text(pool: asyncpg.Pool, claim: Claim, *pieces: str) -> str:
    """Journal content deltas behind the fence, as the emitter would; returns their text."""
    await append_events(pool, claim, [NewEvent(claim.last_seq + 1 + i, EventType.CONTENT_DELTA,
                                               {"delta": piece})
                                      for i, piece in enumerate(pieces)])
    return "".join(pieces)


async def test_a_reaped_turn_keeps_its_streamed_text_after_its_repaired_calls(
        pool: asyncpg.Pool) -> None:
    claim = await claim_with_open_calls(pool, lease_ttl_s=0.05)
    text = await stream_text(pool, claim, "Let me ", "check… ", "é 🙂")
    await wait_lease_expired(pool, claim.run_id)
    assert await reap_expired(pool) == [claim.run_id]
    # The answer comes after the tool results: the next request is well-formed.
    assert await transcript(pool, claim.run_id) == [*ANSWERED, ("assistant", None, "failed")]
    answer = await pool.fetchrow("SELECT id, content FROM message WHERE run_id = $1"
                                 " AND role = 'assistant' AND tool_calls IS NULL", claim.run_id)
    assert answer["content"] == text
    complete = await pool.fetchval("SELECT payload FROM run_event WHERE run_id = $1"
                                   " AND type = 'complete'", claim.run_id)
    assert complete["message_id"] == str(answer["id"])


async def test_a_failed_ending_stores_the_journals_text_whatever_the_caller_passes(
        pool: asyncpg.Pool) -> None:
    # The dispatcher's backstop passes no text; a worker might pass text the journal lacks.
    for given in (None, "text no client ever saw"):
        claim = await claim_with_open_calls(pool)
        text = await stream_text(pool, claim, "partial ", "answer")
        message_id = await finish_run(pool, claim, RunStatus.FAILED, seq=None, content=given,
                                      error="boom")
        stored = await pool.fetchrow("SELECT id, content, status FROM message WHERE run_id = $1"
                                     " AND role = 'assistant' AND tool_calls IS NULL",
                                     claim.run_id)
        assert (stored["id"], stored["content"], stored["status"]) == \
            (message_id, text, MessageStatus.FAILED)


async def test_a_failed_turn_that_streamed_nothing_stores_no_answer(pool: asyncpg.Pool) -> None:
    claim = await claim_with_open_calls(pool, lease_ttl_s=0.05)
    await wait_lease_expired(pool, claim.run_id)
    assert await reap_expired(pool) == [claim.run_id]
    assert await transcript(pool, claim.run_id) == ANSWERED
