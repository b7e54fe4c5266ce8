"""Idempotent enqueue under real races: 20 POSTs released together with one Idempotency-Key make
exactly one run, and every one of them answers with it; the same key with another payload is a
409 naming the first run, never a second run.
"""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import UUID

import httpx

from tests.streams.helpers import run_body
from tests.support.factories import create_conversation, new_device

PARALLEL = 20
ROUNDS = 3


async def post_together(client: httpx.AsyncClient, conversation_id: str, key: str,
                        bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """POST every body at once: each request waits at a barrier, then all go."""
    barrier = asyncio.Barrier(len(bodies))

    async def post(body: dict[str, Any]) -> httpx.Response:
        await barrier.wait()
        return await client.post(f"/v1/conversations/{conversation_id}/runs", json=body,
                                 headers={"Idempotency-Key": key})

    return await asyncio.gather(*(post(body) for body in bodies))


async def runs_with_key(pool, key: str) -> list[Any]:
    return await pool.fetch("SELECT id, conversation_id FROM agent_run WHERE idempotency_key = $1",
                            key)


async def effects(pool, conversation_id: str) -> tuple[int, int, int]:
    """Runs, user messages and journal rows of a conversation: what a duplicate would add to."""
    row = await pool.fetchrow(
        "SELECT (SELECT count(*) FROM agent_run WHERE conversation_id = $1) AS runs,"
        " (SELECT count(*) FROM message WHERE conversation_id = $1 AND role = 'user') AS asked,"
        " (SELECT count(*) FROM run_event e JOIN agent_run r ON r.id = e.run_id"
        "   WHERE r.conversation_id = $1 AND e.type IN ('user_message', 'run_queued'))"
        " AS queued_events", UUID(conversation_id))
    return row["runs"], row["asked"], row["queued_events"]


async def test_parallel_posts_with_one_key_make_one_run_and_all_answer_it(spawn_daemon, pool):
    daemon = spawn_daemon()
    await daemon.wait_ready()
    device = await new_device(pool, "a", "laptop")
    # httpx's default pool opens up to 100 connections: the 20 requests really run in parallel.
    async with device.client(daemon) as client, asyncio.timeout(120):
        for round_ in range(ROUNDS):
            conversation = await create_conversation(client)
            key = f"retry-storm-{round_}"
            body = run_body(f"only once, round {round_}", tokens=2)
            answers = await post_together(client, conversation, key, [body] * PARALLEL)

            assert [a.status_code for a in answers] == [202] * PARALLEL, \
                [(a.status_code, a.text) for a in answers if a.status_code != 202]
            run_ids = {a.json()["run_id"] for a in answers}
            assert len(run_ids) == 1, run_ids
            [run_id] = run_ids
            assert {a.headers["Location"] for a in answers} == {f"/v1/runs/{run_id}"}
            assert all(a.json()["conversation_id"] == conversation for a in answers)
            # One request created it; the other 19 were answered with the first run.
            replayed = [a.headers.get("Idempotent-Replayed") == "true" for a in answers]
            assert replayed.count(False) == 1, replayed
            assert [str(r["id"]) for r in await runs_with_key(pool, key)] == [run_id]
            assert await effects(pool, conversation) == (1, 1, 2)

            # Same key, another payload: a conflict naming the first run, and nothing written.
            other = run_body(f"something else, round {round_}", tokens=2)
            conflict = await client.post(f"/v1/conversations/{conversation}/runs", json=other,
                                         headers={"Idempotency-Key": key})
            assert conflict.status_code == 409, conflict.text
            error = conflict.json()["error"]
            assert error["code"] == "idempotency_conflict" and error["run_id"] == run_id
            assert await effects(pool, conversation) == (1, 1, 2)

            # A later retry of the original request still gets the first run.
            again = await client.post(f"/v1/conversations/{conversation}/runs", json=body,
                                      headers={"Idempotency-Key": key})
            assert again.status_code == 202 and again.json()["run_id"] == run_id
            assert again.headers.get("Idempotent-Replayed") == "true"


async def test_parallel_posts_with_one_key_and_two_payloads_let_exactly_one_win(
        spawn_daemon, pool):
    daemon = spawn_daemon()
    await daemon.wait_ready()
    device = await new_device(pool, "a", "laptop")
    async with device.client(daemon) as client, asyncio.timeout(120):
        for round_ in range(ROUNDS):
            conversation = await create_conversation(client)
            key = f"split-{round_}"
            bodies = [run_body(f"payload {i % 2}, round {round_}", tokens=2)
                      for i in range(PARALLEL)]
            answers = await post_together(client, conversation, key, bodies)

            [run] = await runs_with_key(pool, key)
            run_id = str(run["id"])
            won = [body for body, a in zip(bodies, answers, strict=True)
                   if a.status_code == 202]
            lost = [a for a in answers if a.status_code != 202]
            assert won and {b["content"] for b in won} == {won[0]["content"]}, \
                "two different payloads were both accepted for one key"
            assert len(won) == PARALLEL // 2 and len(lost) == PARALLEL // 2
            assert {a.json()["run_id"] for a in answers if a.status_code == 202} == {run_id}
            for a in lost:
                assert a.status_code == 409, a.text
                assert a.json()["error"]["code"] == "idempotency_conflict"
                assert a.json()["error"]["run_id"] == run_id
            assert await effects(pool, conversation) == (1, 1, 2)
            content = await pool.fetchval(
                "SELECT m.content FROM message m JOIN agent_run r ON r.user_message_id = m.id"
                " WHERE r.id = $1", run["id"])
            assert content == won[0]["content"]
