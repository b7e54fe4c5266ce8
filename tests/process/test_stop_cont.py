"""Rule 3: a worker frozen past its lease (SIGSTOP: a GC pause, a suspended VM) is reaped by
another process; when it wakes it is a zombie whose every write is fenced out: it changes no row,
stands down, and then serves new work like any healthy worker.
"""

from __future__ import annotations

import time
from uuid import UUID

from agentd.vocabulary import EventType, RunStatus
from tests.process.helpers import Db, wait_status, wait_streaming
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
HEARTBEAT_S = LEASE["heartbeat_s"]


async def conversation_snapshot(db: Db, conversation_id: UUID) -> dict[str, list[tuple]]:
    """Every row a worker of this conversation could write: runs, journal, messages, lease."""
    queries = {
        "runs": "SELECT id, status, error, usage, worker_id, claim_token, fence,"
                " lease_expires_at, last_heartbeat_at, cancel_requested, started_at,"
                " finished_at FROM agent_run WHERE conversation_id = $1 ORDER BY created_at, id",
        "journal": "SELECT e.run_id, e.seq, e.type, e.payload::text, e.created_at"
                   " FROM run_event e JOIN agent_run r ON r.id = e.run_id"
                   " WHERE r.conversation_id = $1 ORDER BY e.run_id, e.seq",
        "messages": "SELECT id, run_id, role, content, status, tool_calls::text"
                    " FROM message WHERE conversation_id = $1 ORDER BY position",
        "lease": "SELECT run_id, execution_id, fence, worker_id FROM conversation_lease"
                 " WHERE conversation_id = $1",
    }
    return {name: [tuple(row) for row in await db.fetch(sql, conversation_id)]
            for name, sql in queries.items()}


async def test_frozen_worker_reaped_then_woken_writes_nothing_and_stands_down(
        spawn_daemon, pool):
    sleeper = spawn_daemon(name="sleeper", **LEASE)
    await sleeper.wait_ready()
    account = await new_account(pool)
    conversation = await new_conversation(pool, account)
    turn = await enqueue_demo(pool, account, conversation, "think for a while", tokens=2000,
                              delay_ms=20)
    await wait_streaming(pool, turn.run_id, timeout=10)
    claimed = await run_row(pool, turn.run_id)
    assert claimed["worker_id"] == sleeper.worker_id

    sleeper.stop()
    assert sleeper.process_state() == "T"
    reaper = spawn_daemon(name="reaper", reap_interval_s=0.2, reap_grace_s=0, **LEASE)
    await reaper.wait_ready()
    reaped = await wait_status(pool, turn.run_id, RunStatus.FAILED, timeout=15)
    assert reaped["error_code"] == "lease_expired"
    # The reaper is gone before the sleeper wakes, so whatever changes next is the sleeper's.
    reaper.terminate()
    assert await reaper.wait_exit(10) == 0
    assert sleeper.process_state() == "T", "the sleeper woke before the reap was observed"
    before = await conversation_snapshot(pool, conversation)
    await assert_journal_sound(pool, turn.run_id)

    sleeper.cont()
    # Demonstrably running again: its event loop answers, and it noticed the lost lease.
    assert (await sleeper.healthz())["worker_id"] == sleeper.worker_id
    await sleeper.wait_for_log("lease lost", timeout=10)
    # Watch for three heartbeat periods: a zombie beat, append or terminal write would show.
    watch_until = time.monotonic() + 3 * HEARTBEAT_S
    while time.monotonic() < watch_until:
        assert await conversation_snapshot(pool, conversation) == before
    assert await conversation_snapshot(pool, conversation) == before

    journal = await read_journal(pool, turn.run_id)
    [complete] = of_type(journal, EventType.COMPLETE)
    assert complete["payload"]["status"] == RunStatus.FAILED
    assert len(of_type(journal, EventType.RUN_STARTED)) == 1
    # The reaper kept what had streamed; the zombie's own buffered text never landed.
    [kept] = await assistant_messages(pool, turn.run_id)
    assert (kept["content"], kept["status"]) == (streamed_text(journal), "failed")

    # It stood down, not out: the same process claims the conversation's next turn normally.
    nxt = await enqueue_demo(pool, account, conversation, "and now?", tokens=5)
    done = await wait_status(pool, nxt.run_id, (RunStatus.COMPLETED, RunStatus.FAILED),
                             timeout=10)
    assert (done["status"], done["worker_id"]) == (RunStatus.COMPLETED, sleeper.worker_id)
    [answer] = await assistant_messages(pool, nxt.run_id)
    assert answer["content"] == nxt.expected
    assert (await run_row(pool, turn.run_id))["status"] == RunStatus.FAILED
