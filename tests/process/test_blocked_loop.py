"""Rule 3 with the process alive: a worker whose event loop is blocked longer than its lease (a
runaway computation, a blocking call) loses its runs to another process's reaper, and when its
loop runs again every write it still had in hand is fenced out.

Unlike SIGSTOP (test_stop_cont.py), the process keeps running; only its loop stops, so nothing
that beats from another thread could keep a lease alive for a worker that makes no progress.
The block comes from a test-only hook: SIGUSR2 sleeps on the loop for AGENTD_TESTHOOK_BLOCK_LOOP_S.
"""

from __future__ import annotations

import signal
import time

from prometheus_client.parser import text_string_to_metric_families

from agentd.vocabulary import EventType, RunStatus
from tests.process.helpers import wait_status, wait_streaming
from tests.process.test_stop_cont import conversation_snapshot
from tests.support.factories import enqueue_demo, new_account, new_conversation
from tests.support.journal import (
    assert_journal_sound,
    assistant_messages,
    of_type,
    run_row,
    streamed_text,
)

LEASE = {"lease_ttl_s": 2, "heartbeat_s": 0.5}
BLOCK_S = 6  # three leases: long past the lease and the reaper's next sweep


async def test_blocked_event_loop_loses_its_runs_and_its_late_writes_are_fenced_out(
        spawn_daemon, pool):
    stalled = spawn_daemon(name="stalled", env={"AGENTD_TESTHOOK_BLOCK_LOOP_S": str(BLOCK_S)},
                           flush_ms=50, **LEASE)
    await stalled.wait_ready()
    account = await new_account(pool)
    conversation = await new_conversation(pool, account)
    turn = await enqueue_demo(pool, account, conversation, "a long answer", tokens=5000,
                              delay_ms=5)
    await wait_streaming(pool, turn.run_id, timeout=10, min_deltas=3)
    assert (await run_row(pool, turn.run_id))["worker_id"] == stalled.worker_id
    reaper = spawn_daemon(name="reaper", reap_interval_s=0.2, reap_grace_s=0, **LEASE)
    await reaper.wait_ready()

    blocked_at = time.monotonic()
    stalled.send_signal(signal.SIGUSR2)
    await stalled.wait_for_log("test hook: blocking the event loop", timeout=5)
    reaped = await wait_status(pool, turn.run_id, RunStatus.FAILED, timeout=BLOCK_S + 10)
    assert time.monotonic() - blocked_at < BLOCK_S, \
        "the run was not reaped while the loop was blocked"
    assert reaped["error_code"] == "lease_expired"
    assert stalled.running  # the process lived on; only its loop stood still
    before = await conversation_snapshot(pool, conversation)

    # The loop runs again: pending flushes, the next delta, the beat all try to write.
    await stalled.wait_for_log("test hook: the event loop runs again", timeout=BLOCK_S + 10)
    await stalled.wait_for_log("lease lost", timeout=10)
    watch_until = time.monotonic() + 4 * LEASE["heartbeat_s"]
    while time.monotonic() < watch_until:
        assert await conversation_snapshot(pool, conversation) == before
    assert await conversation_snapshot(pool, conversation) == before

    journal = await assert_journal_sound(pool, turn.run_id)
    [complete] = of_type(journal, EventType.COMPLETE)
    assert complete["payload"]["status"] == RunStatus.FAILED
    [kept] = await assistant_messages(pool, turn.run_id)
    assert (kept["content"], kept["status"]) == (streamed_text(journal), "failed")

    # The stall is on record: a loop-lag sample of more than five seconds.
    scraped = await stalled.request("GET", "/metrics")
    lag = next(f for f in text_string_to_metric_families(scraped.text)
               if f.name == "agentd_event_loop_lag_seconds")
    buckets = {s.labels["le"]: s.value for s in lag.samples if s.name.endswith("_bucket")}
    assert buckets["+Inf"] > buckets["5.0"], buckets

    # It stood down, not out: its next turn runs normally.
    nxt = await enqueue_demo(pool, account, conversation, "and now?", tokens=5)
    done = await wait_status(pool, nxt.run_id, (RunStatus.COMPLETED, RunStatus.FAILED),
                             timeout=15)
    assert done["status"] == RunStatus.COMPLETED, done["error"]
