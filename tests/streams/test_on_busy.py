"""on_busy decides what a new turn does to a busy conversation: `reject` answers 409 naming the
owning run and its device (and writes nothing); `interrupt` stops the running turn (its partial
answer kept), cancels the queued ones (their drafts handed back in the answer) and queues itself,
which then runs — after the interrupted turn ended, never beside it.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from uuid import UUID

from agentd.providers.demo import expected_answer
from tests.streams.helpers import (
    get_conversation,
    get_run,
    post_run,
    run_body,
    wait_status,
    wait_terminal,
)
from tests.support.daemon import ADMIT_ANY_LOAD, poll_until
from tests.support.factories import create_conversation, new_device
from tests.support.journal import assistant_message, journaled_deltas, read_journal

LONG_TOKENS, LONG_DELAY_MS = 3000, 10  # 30 s: it only ends because it is interrupted


async def count_runs(pool, conversation_id: str) -> int:
    return await pool.fetchval("SELECT count(*) FROM agent_run WHERE conversation_id = $1",
                               UUID(conversation_id))


async def test_reject_when_idle_is_accepted_and_when_busy_names_the_owner(spawn_daemon, pool):
    daemon = spawn_daemon(**ADMIT_ANY_LOAD)
    await daemon.wait_ready()
    laptop = await new_device(pool, "a", "laptop")
    desktop = await new_device(pool, "a", "desktop")
    async with laptop.client(daemon) as on_laptop, desktop.client(daemon) as on_desktop, \
            asyncio.timeout(120):
        conversation = await create_conversation(on_laptop)
        idle = await post_run(on_desktop, conversation, "nothing runs", tokens=3,
                              on_busy="reject")
        assert idle["status"] == "running"  # an idle daemon starts it in the same commit
        assert (await wait_terminal(on_laptop, idle["run_id"], 30))["status"] == "completed"

        owner = await post_run(on_laptop, conversation, "a long one", tokens=LONG_TOKENS,
                               delay_ms=LONG_DELAY_MS)
        running = await wait_status(on_laptop, owner["run_id"], "running", 30)
        before = await count_runs(pool, conversation)
        for content in ("me too", "and me"):
            busy = await on_desktop.post(f"/v1/conversations/{conversation}/runs",
                                         json=run_body(content, tokens=3, on_busy="reject"))
            assert busy.status_code == 409, busy.text
            error = busy.json()["error"]
            assert error["code"] == "conversation_busy"
            assert error["run_id"] == owner["run_id"] and error["run_status"] == "running"
            assert error["device"] == "laptop"  # who asked, not who is asking now
            assert error["worker_id"] == running["worker_id"] == daemon.worker_id
            assert owner["run_id"] in error["message"]
        # A rejection writes nothing at all.
        assert await count_runs(pool, conversation) == before
        state = await get_conversation(on_desktop, conversation)
        assert [m["content"] for m in state["messages"] if m["role"] == "user"] == \
            ["nothing runs", "a long one"]
        assert (await get_run(on_laptop, owner["run_id"]))["status"] == "running"


async def test_interrupt_cancels_running_and_queued_turns_then_runs(spawn_daemon, pool):
    daemon = spawn_daemon()
    await daemon.wait_ready()
    laptop = await new_device(pool, "a", "laptop")
    desktop = await new_device(pool, "a", "desktop")
    async with laptop.client(daemon) as on_laptop, desktop.client(daemon) as on_desktop, \
            asyncio.timeout(120):
        conversation = await create_conversation(on_laptop)
        long = await post_run(on_laptop, conversation, "talk for a while", tokens=LONG_TOKENS,
                              delay_ms=LONG_DELAY_MS)
        await wait_status(on_laptop, long["run_id"], "running", 30)

        async def streaming() -> bool:
            return await journaled_deltas(pool, long["run_id"]) >= 2

        await poll_until(streaming, 30, what="the long turn to stream")
        queued = await post_run(on_laptop, conversation, "then this", tokens=5)
        assert queued["status"] == "queued"

        now = await post_run(on_desktop, conversation, "no, this instead", tokens=20,
                             on_busy="interrupt")
        assert now["status"] == "queued" and now["run_id"] not in (long["run_id"],
                                                                   queued["run_id"])
        [draft] = now["drafts"]
        assert draft["run_id"] == queued["run_id"] and draft["content"] == "then this"

        long_run = await wait_terminal(on_laptop, long["run_id"], 30)
        queued_run = await get_run(on_laptop, queued["run_id"])
        new_run = await wait_terminal(on_desktop, now["run_id"], 30)
        state = await get_conversation(on_desktop, conversation)

    assert long_run["status"] == "cancelled" and long_run["cancel_requested"] is True
    assert queued_run["status"] == "cancelled" and queued_run["started_at"] is None
    assert new_run["status"] == "completed" and new_run["error"] is None
    # One turn at a time: the new turn started only after the interrupted one ended.
    assert datetime.fromisoformat(new_run["started_at"]) >= \
        datetime.fromisoformat(long_run["finished_at"])

    # The interrupted answer is kept as a partial: exactly what its journal streamed.
    partial = await assistant_message(pool, long["run_id"])
    streamed = "".join(e["payload"]["delta"] for e in await read_journal(pool, long["run_id"])
                       if e["type"] == "content_delta")
    full = expected_answer("demo", "talk for a while", LONG_TOKENS)
    assert partial["status"] == "partial"
    assert partial["content"] == streamed and partial["content"]
    assert full.startswith(partial["content"]) and len(partial["content"]) < len(full)
    long_events = [e["type"] for e in await read_journal(pool, long["run_id"])]
    assert long_events[-2:] == ["cancel_requested", "complete"]
    # The queued turn never started: no worker event, only its cancellation.
    queued_events = await read_journal(pool, queued["run_id"])
    assert [e["type"] for e in queued_events] == ["user_message", "run_queued", "complete"]
    assert queued_events[-1]["payload"]["status"] == "cancelled"
    answer = await assistant_message(pool, now["run_id"])
    assert (answer["content"], answer["status"]) == (
        expected_answer("demo", "no, this instead", 20), "complete")

    # The transcript: each answer after its own question; the handed-back turn is a draft.
    transcript = [(m["role"], m["status"], m["run_id"]) for m in state["messages"]]
    assert transcript == [
        ("user", "complete", long["run_id"]),
        ("assistant", "partial", long["run_id"]),
        ("user", "draft", queued["run_id"]),
        ("user", "complete", now["run_id"]),
        ("assistant", "complete", now["run_id"]),
    ]
    assert state["runs"] == [] and state["lease"] is None
