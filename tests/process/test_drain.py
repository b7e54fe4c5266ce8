"""Two-phase drain: SIGTERM stops claiming at once, lets in-flight turns finish within the drain
budget, ends the rest `failed` (journaled, never re-queued), and exits 0 within the budget.
"""

from __future__ import annotations

import signal
import time

import pytest

from agentd.dispatcher import DRAIN_FAILURE
from agentd.vocabulary import EventType, RunStatus
from tests.process.helpers import LONG_DRAIN_S, database_now, wait_streaming
from tests.support.daemon import poll_until
from tests.support.factories import enqueue_demo, new_account, new_conversation
from tests.support.journal import (
    assert_journal_sound,
    assistant_messages,
    of_type,
    read_journal,
    run_row,
    streamed_text,
)

DRAIN_S = 2.0
EXIT_MARGIN_S = 3.0


async def test_sigterm_drains_short_turns_fails_long_ones_and_exits_zero(spawn_daemon, pool):
    daemon = spawn_daemon(drain_s=DRAIN_S)
    await daemon.wait_ready()
    account = await new_account(pool)

    async def turn(content: str, tokens: int, delay_ms: int):
        conversation = await new_conversation(pool, account)
        return await enqueue_demo(pool, account, conversation, content, tokens=tokens,
                                  delay_ms=delay_ms)

    long = [await turn(f"long {n}", tokens=500, delay_ms=20) for n in range(2)]  # ~10 s
    short = [await turn(f"short {n}", tokens=40, delay_ms=20) for n in range(3)]  # ~0.8 s
    ids = [t.run_id for t in (*long, *short)]

    async def all_running() -> bool:
        return await pool.fetchval("SELECT count(*) FROM agent_run WHERE id = ANY($1)"
                                   " AND status = 'running'", ids) == len(ids)

    await poll_until(all_running, 10, what="every turn to be running")

    signalled_at = await database_now(pool)
    started = time.monotonic()
    daemon.terminate()

    # Phase 1: once it reports draining it claims nothing, NOTIFY or not.
    async def draining() -> bool:
        return (await daemon.readyz())["draining"]

    await poll_until(draining, 5, what="readyz to report draining")
    late = await turn("too late", tokens=3, delay_ms=0)

    code = await daemon.wait_exit(DRAIN_S + EXIT_MARGIN_S + 5)
    elapsed = time.monotonic() - started
    assert code == 0
    assert elapsed < DRAIN_S + EXIT_MARGIN_S, f"exited {elapsed:.2f}s after SIGTERM"

    for t in short:  # in flight at the signal, finished within the budget
        row = await run_row(pool, t.run_id)
        assert row["status"] == RunStatus.COMPLETED, row["error"]
        assert row["finished_at"] > signalled_at, "finished before the drain: proves nothing"
        [answer] = await assistant_messages(pool, t.run_id)
        assert (answer["content"], answer["status"]) == (t.expected, "complete")
    for t in long:  # outlived the budget: failed, with a journaled ending
        row = await run_row(pool, t.run_id)
        assert (row["status"], row["error"], row["error_code"]) == \
            (RunStatus.FAILED, DRAIN_FAILURE.message, "shutdown")
        journal = await assert_journal_sound(pool, t.run_id)
        [complete] = of_type(journal, EventType.COMPLETE)
        assert complete["payload"]["status"] == RunStatus.FAILED
        assert (complete["payload"]["error"], complete["payload"]["error_code"]) == \
            (DRAIN_FAILURE.message, "shutdown")
        # What it had streamed when the budget ran out stays, as its failed answer.
        [kept] = await assistant_messages(pool, t.run_id)
        assert (kept["content"], kept["status"]) == (streamed_text(journal), "failed")
        assert complete["payload"]["message_id"] == str(kept["id"])
    for t in (*short, *long):  # executed once, never handed back to the queue
        journal = await assert_journal_sound(pool, t.run_id)
        assert len(of_type(journal, EventType.RUN_QUEUED)) == 1
        [started_event] = of_type(journal, EventType.RUN_STARTED)
        assert started_event["payload"]["worker_id"] == daemon.worker_id
    assert await pool.fetchval(
        "SELECT count(*) FROM agent_run WHERE status IN ('queued', 'running') AND id <> $1",
        late.run_id) == 0
    assert await pool.fetchval("SELECT count(*) FROM conversation_lease") == 0

    untouched = await run_row(pool, late.run_id)
    assert (untouched["status"], untouched["worker_id"]) == (RunStatus.QUEUED, None)
    assert [e["type"] for e in await read_journal(pool, late.run_id)] == \
        [EventType.USER_MESSAGE, EventType.RUN_QUEUED]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1], ids=["ctrl-c", "sigusr1"])
async def test_a_second_ctrl_c_or_sigusr1_cuts_the_drain_short_and_exits_zero(
        spawn_daemon, pool, signum):
    """The turns still running end `failed` at once, as when the drain's time is up, instead
    of after the whole `drain_s`."""
    daemon = spawn_daemon(drain_s=LONG_DRAIN_S)
    await daemon.wait_ready()
    account = await new_account(pool)
    turn = await enqueue_demo(pool, account, await new_conversation(pool, account), "long",
                              tokens=3000, delay_ms=20)  # ~60 s
    await wait_streaming(pool, turn.run_id, timeout=10)
    daemon.terminate()
    await daemon.wait_for_log("draining the turns in flight", 10)
    assert (await run_row(pool, turn.run_id))["status"] == RunStatus.RUNNING
    daemon.send_signal(signum)
    assert await daemon.wait_exit(LONG_DRAIN_S / 4) == 0
    row = await run_row(pool, turn.run_id)
    assert (row["status"], row["error"], row["error_code"]) == \
        (RunStatus.FAILED, DRAIN_FAILURE.message, "shutdown")
    journal = await assert_journal_sound(pool, turn.run_id)
    [kept] = await assistant_messages(pool, turn.run_id)
    assert (kept["content"], kept["status"]) == (streamed_text(journal), "failed")
    assert "cancelling the turns still running" in daemon.log_text()
