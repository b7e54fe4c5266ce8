"""Rules 2 and 5 across processes: two daemons share one queue; every run executes exactly once,
each conversation one turn at a time in the order its turns were queued, and both do work.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from uuid import UUID

from agentd.vocabulary import EventType, RunStatus
from tests.support.daemon import poll_until
from tests.support.factories import enqueue_demo, new_account, new_conversation

CONVERSATIONS = 50
TURNS_PER_CONVERSATION = 4
TOKENS = 5


async def test_two_daemons_run_every_turn_once_in_conversation_order(spawn_daemon, pool):
    daemons = [spawn_daemon(name="left"), spawn_daemon(name="right")]
    for daemon in daemons:
        await daemon.wait_ready()
    workers = {daemon.worker_id for daemon in daemons}
    account = await new_account(pool)
    conversations = [await new_conversation(pool, account) for _ in range(CONVERSATIONS)]

    queued: dict[UUID, list[UUID]] = defaultdict(list)  # conversation -> runs, enqueue order
    expected: dict[UUID, str] = {}
    # One commit makes every turn claimable at once (each enqueue's NOTIFY fires with it), so
    # each conversation really has a queue of turns for the two daemons to race over.
    async with pool.acquire() as conn, conn.transaction():
        for n in range(TURNS_PER_CONVERSATION):
            for c, conversation in enumerate(conversations):
                turn = await enqueue_demo(conn, account, conversation,
                                          f"conversation {c} turn {n}", tokens=TOKENS,
                                          delay_ms=(c + n) % 6)
                queued[conversation].append(turn.run_id)
                expected[turn.run_id] = turn.expected
    total = CONVERSATIONS * TURNS_PER_CONVERSATION

    async def all_terminal() -> bool:
        return await pool.fetchval(
            "SELECT count(*) FROM agent_run WHERE status IN ('completed', 'failed',"
            " 'cancelled')") == total

    await poll_until(all_terminal, 60, interval=0.1, what=f"{total} runs to end")

    runs = await pool.fetch(
        "SELECT id, conversation_id, status, error, worker_id, started_at, finished_at"
        " FROM agent_run")
    assert len(runs) == total
    failed = [(r["id"], r["status"], r["error"]) for r in runs if r["status"] != "completed"]
    assert failed == []

    # Executed once: one start and one ending per run, by a worker that claimed it.
    journal = await pool.fetch(
        "SELECT run_id, type, payload FROM run_event WHERE type IN ('run_started', 'complete')")
    starts = Counter(e["run_id"] for e in journal if e["type"] == EventType.RUN_STARTED)
    endings = Counter(e["run_id"] for e in journal if e["type"] == EventType.COMPLETE)
    assert set(starts.values()) == {1} and len(starts) == total, "a run started twice or never"
    assert set(endings.values()) == {1} and len(endings) == total
    assert {e["payload"]["status"] for e in journal if e["type"] == EventType.COMPLETE} == \
        {RunStatus.COMPLETED}
    started_by = {e["run_id"]: e["payload"]["worker_id"] for e in journal
                  if e["type"] == EventType.RUN_STARTED}
    assert {r["id"]: r["worker_id"] for r in runs} == started_by
    share = Counter(started_by.values())
    assert set(share) == workers, f"work was not shared between both daemons: {share}"

    # One turn at a time per conversation, in the order the turns were queued.
    by_conversation: dict[UUID, list] = defaultdict(list)
    for run in runs:
        by_conversation[run["conversation_id"]].append(run)
    for conversation, order in queued.items():
        ran = sorted(by_conversation[conversation], key=lambda r: r["started_at"])
        assert [r["id"] for r in ran] == order, f"conversation {conversation} ran out of order"
        for before, after in itertools.pairwise(ran):
            assert before["finished_at"] <= after["started_at"], \
                f"turns {before['id']} and {after['id']} overlapped"

    answers = await pool.fetch(
        "SELECT run_id, content, status FROM message WHERE role = 'assistant'")
    assert len(answers) == total
    assert {a["run_id"]: (a["content"], a["status"]) for a in answers} == \
        {run_id: (text, "complete") for run_id, text in expected.items()}
    assert await pool.fetchval("SELECT count(*) FROM conversation_lease") == 0
    for daemon in daemons:
        assert daemon.running
