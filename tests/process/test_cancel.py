"""Rule 8: stop is a state. The NOTIFY stops a running turn at once; without it the heartbeat's
re-read of the flag stops it within one beat. Either way the partial answer is kept.
"""

from __future__ import annotations

import time
from datetime import timedelta

from agentd.queue import stop_conversation
from agentd.vocabulary import EventType, MessageStatus, RunStatus
from tests.process.helpers import Db, wait_status, wait_streaming
from tests.support.factories import Turn, enqueue_demo, new_account, new_conversation
from tests.support.journal import (
    assert_journal_sound,
    assistant_messages,
    of_type,
    run_row,
    streamed_text,
)


async def start_long_turn(db: Db) -> Turn:
    account = await new_account(db)
    conversation = await new_conversation(db, account)
    turn = await enqueue_demo(db, account, conversation, "tell me everything", tokens=2000,
                              delay_ms=20)
    await wait_streaming(db, turn.run_id, timeout=10, min_deltas=2)
    return turn


async def assert_cancelled_keeping_partial_answer(db: Db, turn: Turn) -> None:
    row = await run_row(db, turn.run_id)
    assert (row["status"], row["cancel_requested"]) == (RunStatus.CANCELLED, True)
    journal = await assert_journal_sound(db, turn.run_id)
    [complete] = of_type(journal, EventType.COMPLETE)
    assert complete["payload"]["status"] == RunStatus.CANCELLED
    assert len(of_type(journal, EventType.CANCEL_REQUESTED)) == 1

    [answer] = await assistant_messages(db, turn.run_id)
    assert answer["status"] == MessageStatus.PARTIAL
    assert complete["payload"]["message_id"] == str(answer["id"])
    text = answer["content"]
    assert text, "the partial answer was dropped"
    assert len(text) < len(turn.expected), "it ran to the end: the stop did not stop it"
    assert turn.expected.startswith(text)
    assert text == streamed_text(journal), "transcript and journal disagree"
    assert await db.fetchval(
        "SELECT count(*) FROM conversation_lease WHERE conversation_id = $1",
        turn.conversation_id) == 0


async def test_stop_with_hub_up_cancels_well_under_one_heartbeat(spawn_daemon, pool):
    heartbeat_s = 5
    daemon = spawn_daemon(heartbeat_s=heartbeat_s, lease_ttl_s=15)
    await daemon.wait_ready()
    turn = await start_long_turn(pool)
    # The next periodic beat is far enough away that it cannot be what stops the run.
    since_beat = await pool.fetchval(
        "SELECT clock_timestamp() - last_heartbeat_at FROM agent_run WHERE id = $1",
        turn.run_id)
    assert since_beat < timedelta(seconds=heartbeat_s - 2.5)

    started = time.monotonic()
    result = await stop_conversation(pool, account_id=turn.account_id,
                                     conversation_id=turn.conversation_id)
    assert result.flagged == [turn.run_id]
    await wait_status(pool, turn.run_id, (RunStatus.CANCELLED, RunStatus.COMPLETED,
                                          RunStatus.FAILED), timeout=heartbeat_s * 2)
    elapsed = time.monotonic() - started
    assert elapsed < 2, f"stopped after {elapsed:.2f}s: the heartbeat, not the NOTIFY"
    await assert_cancelled_keeping_partial_answer(pool, turn)


async def test_stop_with_notify_lost_cancels_within_one_heartbeat(spawn_daemon, pool):
    heartbeat_s = 1
    daemon = spawn_daemon(heartbeat_s=heartbeat_s, lease_ttl_s=3)
    await daemon.wait_ready()
    turn = await start_long_turn(pool)

    started = time.monotonic()
    # The flag alone, no NOTIFY: as if the signal had been lost on the way.
    assert await pool.execute("UPDATE agent_run SET cancel_requested = true WHERE id = $1",
                              turn.run_id) == "UPDATE 1"
    await wait_status(pool, turn.run_id, (RunStatus.CANCELLED, RunStatus.COMPLETED,
                                          RunStatus.FAILED), timeout=heartbeat_s * 10)
    elapsed = time.monotonic() - started
    assert elapsed < 3 * heartbeat_s, f"stopped after {elapsed:.2f}s"
    await assert_cancelled_keeping_partial_answer(pool, turn)


async def test_stop_landing_mid_journal_write_still_ends_cancelled(spawn_daemon, pool):
    # A 1 ms flush clock and no pacing keep the emitter writing almost all the time, so the
    # stop nearly always cancels the turn while a journal batch is in flight or waiting.
    daemon = spawn_daemon(flush_ms=1)
    await daemon.wait_ready()
    account = await new_account(pool)
    for n in range(3):
        conversation = await new_conversation(pool, account)
        turn = await enqueue_demo(pool, account, conversation, f"flood {n}", tokens=100_000)
        await wait_streaming(pool, turn.run_id, timeout=10, min_deltas=2)
        await stop_conversation(pool, account_id=account, conversation_id=conversation)
        row = await wait_status(pool, turn.run_id, (RunStatus.CANCELLED, RunStatus.COMPLETED,
                                                    RunStatus.FAILED), timeout=10)
        assert row["status"] == RunStatus.CANCELLED, row["error"]
        await assert_cancelled_keeping_partial_answer(pool, turn)
