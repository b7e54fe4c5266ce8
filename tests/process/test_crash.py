"""Rules 3-4: a worker killed with -9 mid-turn is reaped `failed` by another process once its
lease passes, its conversation moves on, and nothing ever runs the dead turn again; what it had
streamed stays in the transcript as a `failed` answer.
"""

from __future__ import annotations

from agentd.vocabulary import EventType, MessageStatus, RunStatus
from tests.process.helpers import wait_status, wait_streaming
from tests.support.factories import enqueue_demo, new_account, new_conversation
from tests.support.journal import (
    assert_journal_sound,
    assistant_messages,
    of_type,
    read_journal,
    run_row,
    streamed_text,
)

LEASE = {"lease_ttl_s": 2, "heartbeat_s": 0.5}


async def test_killed_worker_is_reaped_failed_and_the_next_turn_runs(spawn_daemon, pool):
    doomed = spawn_daemon(name="doomed", **LEASE)
    await doomed.wait_ready()
    account = await new_account(pool)
    conversation = await new_conversation(pool, account)
    long = await enqueue_demo(pool, account, conversation, "a long answer", tokens=2000,
                              delay_ms=20)
    await wait_streaming(pool, long.run_id, timeout=10)
    nxt = await enqueue_demo(pool, account, conversation, "the next turn", tokens=5)
    claimed = await run_row(pool, long.run_id)
    assert claimed["worker_id"] == doomed.worker_id
    assert (await run_row(pool, nxt.run_id))["status"] == RunStatus.QUEUED  # one turn at a time

    doomed.kill()
    assert await doomed.wait_exit(5) == -9
    assert (await run_row(pool, long.run_id))["status"] == RunStatus.RUNNING  # a tombstone

    reaper = spawn_daemon(name="reaper", reap_interval_s=0.2, reap_grace_s=0, **LEASE)
    await reaper.wait_ready()

    dead = await wait_status(pool, long.run_id, RunStatus.FAILED, timeout=15)
    assert dead["error_code"] == "lease_expired"
    assert dead["finished_at"] >= dead["lease_expires_at"], "reaped before its lease passed"
    journal = await assert_journal_sound(pool, long.run_id)
    [complete] = of_type(journal, EventType.COMPLETE)
    assert complete["payload"]["status"] == RunStatus.FAILED
    assert complete["payload"]["error"] == dead["error"]

    # The conversation is not wedged: its queued turn runs, on the surviving process.
    done = await wait_status(pool, nxt.run_id, (RunStatus.COMPLETED, RunStatus.FAILED),
                             timeout=10)
    assert done["status"] == RunStatus.COMPLETED, done["error"]
    assert done["worker_id"] == reaper.worker_id
    assert done["started_at"] > dead["finished_at"]
    [answer] = await assistant_messages(pool, nxt.run_id)
    assert (answer["content"], answer["status"]) == (nxt.expected, "complete")
    assert await pool.fetchval(
        "SELECT count(*) FROM conversation_lease WHERE conversation_id = $1", conversation) == 0

    # At most once: the dead turn was started once, by the dead process, and stays failed
    # with the claim it died holding (nobody claimed it again).
    after = await run_row(pool, long.run_id)
    assert after["status"] == RunStatus.FAILED
    assert (after["claim_token"], after["fence"], after["worker_id"]) == \
        (claimed["claim_token"], claimed["fence"], doomed.worker_id)
    journal = await read_journal(pool, long.run_id)
    [started] = of_type(journal, EventType.RUN_STARTED)
    assert started["payload"]["worker_id"] == doomed.worker_id
    assert len(of_type(journal, EventType.COMPLETE)) == 1
    assert reaper.running


async def test_kill_9_mid_stream_keeps_the_streamed_text_as_a_failed_answer(spawn_daemon, pool):
    """What every client saw of the dead turn stays in the transcript: the reaper stores the
    journal's text as the answer, status `failed`, and the ending names it."""
    doomed = spawn_daemon(name="doomed", **LEASE)
    await doomed.wait_ready()
    account = await new_account(pool)
    conversation = await new_conversation(pool, account)
    turn = await enqueue_demo(pool, account, conversation, "say a lot", tokens=2000,
                              delay_ms=10)
    await wait_streaming(pool, turn.run_id, timeout=10, min_deltas=3)
    doomed.kill()
    assert await doomed.wait_exit(5) == -9
    reaper = spawn_daemon(name="reaper", reap_interval_s=0.2, reap_grace_s=0, **LEASE)
    await reaper.wait_ready()
    await wait_status(pool, turn.run_id, RunStatus.FAILED, timeout=15)

    journal = await assert_journal_sound(pool, turn.run_id)
    text = streamed_text(journal)
    assert len(text) > 10 and turn.expected.startswith(text)
    [answer] = await assistant_messages(pool, turn.run_id)
    assert (answer["content"], answer["status"]) == (text, MessageStatus.FAILED)
    [complete] = of_type(journal, EventType.COMPLETE)
    assert complete["payload"]["message_id"] == str(answer["id"])
    # The next turn's model request sees the kept text as the assistant's answer, in order.
    transcript = await pool.fetch(
        "SELECT role, status FROM message WHERE conversation_id = $1 ORDER BY position",
        conversation)
    assert [(m["role"], m["status"]) for m in transcript] == [
        ("user", "complete"), ("assistant", "failed")]
