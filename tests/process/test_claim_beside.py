"""A turn posted to a daemon with a free slot starts in the commit that wrote it (the claim beside
the enqueue, docs/architecture.md); with no slot free, or with claim_on_enqueue off, it is
queued and the claim loop takes it as before. A turn started beside its enqueue wakes no claim
loop anywhere; one left queued wakes them in its own commit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID, uuid4

import asyncpg

from tests.process.helpers import wait_status
from tests.support.daemon import ADMIT_ANY_LOAD
from tests.support.factories import create_conversation, new_device
from tests.support.lost_answers import AnswerCutter, relayed

UNLOADED = {"tick_s": 60, **ADMIT_ANY_LOAD}  # a turn posted to a free slot always starts at once


async def post_turn(client, conversation: str, **params: int) -> dict:
    response = await client.post(f"/v1/conversations/{conversation}/runs",
                                 json={"content": "go", "params": params})
    assert response.status_code == 202, response.text
    return response.json()


async def test_an_idle_daemon_starts_a_posted_turn_in_its_enqueue_commit(spawn_daemon, pool):
    daemon = spawn_daemon(**UNLOADED)
    await daemon.wait_ready()
    device = await new_device(pool, "beside", "laptop")
    async with device.client(daemon) as client:
        conversation = await create_conversation(client)
        for _ in range(5):
            created = await post_turn(client, conversation, tokens=2, delay_ms=0)
            # "running" in the 202 itself: the claim committed with the enqueue (the
            # integration tier checks that nothing of either is visible before that commit).
            assert created["status"] == "running", created
            run_id = UUID(created["run_id"])
            row = await wait_status(pool, run_id, "completed", timeout=15)
            assert (row["worker_id"], row["error"]) == (daemon.worker_id, None)
    await _assert_every_run_started_once(pool)


async def test_without_a_free_slot_or_with_it_off_the_turn_is_queued_first(spawn_daemon, pool):
    daemon = spawn_daemon(**UNLOADED, max_runs=1)
    off = spawn_daemon(**UNLOADED, claim_on_enqueue=False, name="off")
    await daemon.wait_ready()
    await off.wait_ready()
    device = await new_device(pool, "beside", "laptop")
    async with device.client(daemon) as client, device.client(off) as other:
        busy, waiting, elsewhere = [await create_conversation(client) for _ in range(3)]
        # The daemon's one slot is taken by a long turn...
        long = await post_turn(client, busy, tokens=40, delay_ms=50)
        assert long["status"] == "running"
        # ...so a turn of another conversation posted to it now is only queued.
        queued = await post_turn(client, waiting, tokens=2, delay_ms=0)
        assert queued["status"] == "queued"
        # A daemon with claim_on_enqueue off queues even when idle; a claim loop takes it.
        plain = await post_turn(other, elsewhere, tokens=2, delay_ms=0)
        assert plain["status"] == "queued"
        for created in (long, queued, plain):
            await wait_status(pool, UUID(created["run_id"]), "completed", timeout=30)
    await _assert_every_run_started_once(pool)


async def test_only_a_turn_left_queued_wakes_the_claim_loops(spawn_daemon, pool, dsn):
    """Another process's view: a LISTEN on the claim loops' channel. NOTIFYs arrive in commit
    order, so a marker sent after the POST's answer shows what its commit sent before it."""
    daemon = spawn_daemon(**UNLOADED)
    await daemon.wait_ready()
    device = await new_device(pool, "beside", "laptop")
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(dsn)
    await listener.add_listener("agentd_run_enqueued", lambda *args: heard.put_nowait(args[3]))

    async def heard_before(marker: str) -> list[str]:
        await pool.execute("SELECT pg_notify('agentd_run_enqueued', $1)", marker)
        payloads = []
        async with asyncio.timeout(15):
            while (payload := await heard.get()) != marker:
                payloads.append(payload)
        return payloads

    try:
        async with device.client(daemon) as client:
            conversation = await create_conversation(client)
            # Long enough to outlast both markers: its ending wakes the claim loops (the
            # conversation's next turn may start), which is not what is looked at here.
            first = await post_turn(client, conversation, tokens=200, delay_ms=50)
            assert first["status"] == "running"
            assert await heard_before("after the first post") == []
            second = await post_turn(client, conversation, tokens=2, delay_ms=0)
            assert second["status"] == "queued"  # the conversation is busy
            assert await heard_before("after the second post") == [conversation]
            assert (await pool.fetchval("SELECT status FROM agent_run WHERE id = $1",
                                        UUID(first["run_id"]))) == "running", \
                "the first turn ended before the markers: nothing was shown"
            stopped = await client.post(f"/v1/conversations/{conversation}/stop")
            assert stopped.status_code == 202, stopped.text
            for created in (first, second):
                await wait_status(pool, UUID(created["run_id"]), "cancelled", timeout=15)
    finally:
        await listener.close()


async def test_a_post_whose_commit_answer_was_lost_runs_its_turn(spawn_daemon, pool, dsn):
    """A post with on_busy `reject` runs in a transaction of its own: its claim holds once the
    COMMIT lands. That COMMIT's answer is lost (the relay cuts it): the daemon finds the turn
    by its claim's key, runs it and answers with it. Before, it answered 503 and the turn waited
    for the reaper."""
    marker = "commit lost " + uuid4().hex
    async with relayed_daemon(spawn_daemon, pool, dsn) as (cutter, daemon, client, conversation):
        cutter.cut(marker.encode(), then=b"COMMIT")
        lost = await client.post(f"/v1/conversations/{conversation}/runs", json={
            "content": marker, "on_busy": "reject", "params": {"tokens": 3, "delay_ms": 0}})
        assert cutter.cut_done.is_set(), "the relay never cut the COMMIT's answer"
        assert lost.status_code == 202, lost.text
        row = await wait_status(pool, UUID(lost.json()["run_id"]), "completed", timeout=15)
        assert (row["worker_id"], row["error"]) == (daemon.worker_id, None)
    await _assert_every_run_started_once(pool)


@contextlib.asynccontextmanager
async def relayed_daemon(spawn_daemon: Any, pool: asyncpg.Pool, dsn: str,
                         ) -> AsyncIterator[tuple[AnswerCutter, Any, Any, str]]:
    """A daemon whose database link goes through a relay that can lose answers, a device's
    client of it and a conversation: (relay, daemon, client, conversation id)."""
    async with relayed(spawn_daemon, dsn, **UNLOADED) as (cutter, daemon):
        device = await new_device(pool, "beside", "laptop")
        async with device.client(daemon) as client:
            yield cutter, daemon, client, await create_conversation(client)


async def _assert_every_run_started_once(pool: asyncpg.Pool) -> None:
    starts = await pool.fetch("SELECT r.id, count(e.seq) AS starts FROM agent_run r "
                              "LEFT JOIN run_event e ON e.run_id = r.id AND e.type = 'run_started' "
                              "GROUP BY r.id")
    assert starts and all(row["starts"] == 1 for row in starts), [dict(r) for r in starts]


async def test_a_post_whose_answer_was_lost_runs_its_turn_and_its_retry_gets_it(
        spawn_daemon, pool, dsn):
    """The post's statement commits the turn running under this daemon, then the link to
    PostgreSQL breaks before its answer (a relay withholds it: tests/support/lost_answers.py).
    The daemon finds the turn by its claim's key, runs it and answers with it, as if the
    answer had come; a retry with the same Idempotency-Key gets that turn. Before, the client
    got a 503 and the turn stayed running with nobody executing it until the reaper failed it
    (`lease_expired`)."""
    marker = "answer lost " + uuid4().hex
    async with relayed_daemon(spawn_daemon, pool, dsn) as (cutter, daemon, client, conversation):
        body = {"content": marker, "params": {"tokens": 3, "delay_ms": 0}}
        headers = {"Idempotency-Key": marker.replace(" ", "-")}
        cutter.cut(marker.encode())
        lost = await client.post(f"/v1/conversations/{conversation}/runs", json=body,
                                 headers=headers)
        assert cutter.cut_done.is_set(), "the relay never cut the post's answer"
        assert lost.status_code == 202, lost.text
        [run_id] = await pool.fetchval(
            "SELECT array_agg(r.id) FROM agent_run r JOIN conversation c"
            " ON c.id = r.conversation_id WHERE c.id = $1", UUID(conversation))
        assert lost.json()["run_id"] == str(run_id)
        row = await wait_status(pool, run_id, "completed", timeout=15)
        assert (row["worker_id"], row["error"]) == (daemon.worker_id, None)
        retried = await client.post(f"/v1/conversations/{conversation}/runs", json=body,
                                    headers=headers)
        assert retried.status_code == 202, retried.text
        assert (retried.json()["run_id"], retried.json()["status"]) == (
            str(run_id), "completed")
    await _assert_every_run_started_once(pool)
