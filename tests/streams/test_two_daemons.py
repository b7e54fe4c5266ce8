"""Any process can serve any tail (rule 7): two daemons on one database; the run executes on A,
and a stream opened on B — a process that never touched the run — follows it live to `complete`
with the full text. A client that drops A's stream resumes on B from its last seq.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from uuid import UUID

import httpx
import pytest

from agentd.providers.demo import expected_answer
from tests.streams.helpers import get_run, post_run, wait_terminal
from tests.support.factories import create_conversation, new_device
from tests.support.journal import assistant_message, read_journal
from tests.support.sse import Follower, as_journal, deltas, is_complete, journal_rows, of_run

TOKENS, DELAY_MS = 1500, 5  # ~8 s of streaming: room to start B while A still runs it
PROMPT = "follow me from another process"


async def test_stream_on_daemon_b_follows_a_run_executing_on_daemon_a(spawn_daemon, pool):
    a = spawn_daemon(name="a")
    await a.wait_ready()
    device = await new_device(pool, "a", "laptop")
    async with device.client(a) as on_a, asyncio.timeout(120):
        conversation = await create_conversation(on_a)
        feed = f"/v1/conversations/{conversation}/events"
        # The first part of the answer streams from A; then the client drops its connections.
        async with Follower(on_a, feed, name="feed on A") as feed_a:
            run_id = (await post_run(on_a, conversation, PROMPT, tokens=TOKENS,
                                     delay_ms=DELAY_MS))["run_id"]
            async with Follower(on_a, f"/v1/runs/{run_id}/events", name="stream on A") as first:
                await first.wait_for(lambda f: f.event == "content_delta", 30, "a delta")
            await feed_a.wait_for(lambda f: f.event == "content_delta", 30, "a delta")
        from_a = list(first.frames)
        feed_from_a = list(feed_a.frames)
        running = await get_run(on_a, run_id)
        assert running["status"] == "running" and running["worker_id"] == a.worker_id

        b = spawn_daemon(name="b")
        await b.wait_ready()
        assert b.worker_id != a.worker_id
        async with device.client(b) as on_b:
            last = from_a[-1].seq
            async with Follower(on_b, f"/v1/runs/{run_id}/events", name="stream on B",
                                headers={"Last-Event-ID": str(last)}) as resumed, \
                    Follower(on_b, f"/v1/runs/{run_id}/events", name="full stream on B",
                             params={"from": 0}) as full, \
                    Follower(on_b, feed, name="feed on B",
                             params={"cursor": feed_from_a[-1].id}) as feed_b:
                # The streams are open; whatever A journals from now on is news to B.
                watermark = await pool.fetchrow(
                    "SELECT r.status, (SELECT max(seq) FROM run_event e WHERE e.run_id = r.id)"
                    " AS seq FROM agent_run r WHERE r.id = $1", UUID(run_id))
                await resumed.wait_ended(60)
                await full.wait_ended(60)
                await feed_b.wait_for(is_complete(run_id), 60, "the run's complete")
            final = await wait_terminal(on_b, run_id, 30)

    assert watermark["status"] == "running", "the run ended before B was streaming it"
    answer = expected_answer("demo", PROMPT, TOKENS)
    rows = await read_journal(pool, run_id)
    # The conversation stream, dropped on A and resumed on B by A's cursor, misses nothing.
    assert feed_b.frames[0].event == "snapshot"
    feed_frames = of_run(feed_from_a + feed_b.frames, run_id)
    for name, frames, expected in (
            ("A, then B", from_a + resumed.frames, journal_rows(rows)),
            ("B", full.frames, journal_rows(rows)),
            ("feed on A, then B", feed_frames, journal_rows(rows, run_id))):
        seqs = [f.seq for f in frames]
        assert seqs == list(range(1, len(seqs) + 1)), f"{name}: gap or duplicate: {seqs}"
        assert as_journal(frames) == expected, name
        assert deltas(frames) == answer, name
        assert is_complete()(frames[-1]) and frames[-1].data["status"] == "completed", name
        # B delivered events A journaled after B's stream was already open: it followed live.
        assert frames[-1].seq > watermark["seq"], name
    # A executed it, start to end; B only served the streams.
    [started] = [f for f in full.frames if f.event == "run_started"]
    assert started.data["worker_id"] == a.worker_id
    assert final["status"] == "completed" and final["worker_id"] == a.worker_id
    stored = await assistant_message(pool, run_id)
    assert (stored["content"], stored["status"]) == (answer, "complete")


@contextlib.asynccontextmanager
async def _moved_behind_a(spawn_daemon, pool,
                          ) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient, str]]:
    """Daemons A and B and one device's client of each; a conversation that A saw on
    `demo:echo` (it created it) and B then moved to `demo`, so A's guess of its model is stale."""
    env = {"AGENTD_DEMO_MODELS": "demo,echo"}
    a = spawn_daemon(name="a", env=env)
    b = spawn_daemon(name="b", env=env)
    await a.wait_ready()
    await b.wait_ready()
    device = await new_device(pool, "a", "laptop")
    async with device.client(a) as on_a, device.client(b) as on_b, asyncio.timeout(90):
        created = await on_a.post("/v1/conversations", json={"title": "t", "model": "demo:echo"})
        assert created.status_code == 201, created.text
        conversation = created.json()["id"]
        moved = await on_b.patch(f"/v1/conversations/{conversation}", json={"model": "demo"})
        assert moved.status_code == 200, moved.text
        yield on_a, on_b, conversation


async def _models(pool, conversation: str) -> list[str]:
    rows = await pool.fetch("SELECT request->>'model' AS model FROM agent_run"
                            " WHERE conversation_id = $1 ORDER BY created_at", UUID(conversation))
    return [r["model"] for r in rows]


async def test_a_post_runs_on_the_model_its_conversation_has_now_whatever_this_daemon_saw(
        spawn_daemon, pool):
    """A post that names no model is built on the model the daemon last saw its conversation
    with, and checked by the post's own statement. Daemon A saw the conversation on `demo:echo`;
    daemon B then moves it to `demo`. A's next post must run on `demo` (nothing is written on
    the stale guess: one run, one question), and so must the one after it."""
    async with _moved_behind_a(spawn_daemon, pool) as (on_a, _on_b, conversation):
        runs = []
        for prompt in ("after the change", "and after that"):
            posted = await on_a.post(f"/v1/conversations/{conversation}/runs",
                                     json={"content": prompt, "params": {"tokens": 2}})
            assert posted.status_code == 202, posted.text
            runs.append(await wait_terminal(on_a, posted.json()["run_id"], 30))
    rows = await pool.fetch(
        "SELECT r.request->>'model' AS model, m.content FROM agent_run r"
        " JOIN message m ON m.id = r.user_message_id WHERE r.conversation_id = $1"
        " ORDER BY r.created_at", UUID(conversation))
    assert [(r["model"], r["content"]) for r in rows] == [
        ("demo", "after the change"), ("demo", "and after that")]
    assert [run["status"] for run in runs] == ["completed", "completed"]


@pytest.mark.parametrize("on_busy", ["enqueue", "reject", "interrupt"])
async def test_a_post_repeated_on_a_daemon_with_a_stale_model_is_a_replay(
        spawn_daemon, pool, on_busy):
    """A post repeated under its Idempotency-Key returns the first run wherever it lands. B
    takes the post; the repeat lands on A, whose request, built on the model it saw, differs
    from the stored one until the conversation's row is read: a replay, not a 409 conflict,
    whatever `on_busy` says."""
    body = {"content": "once", "params": {"tokens": 2}, "on_busy": on_busy}
    key = {"Idempotency-Key": f"repeat-{on_busy}"}
    async with _moved_behind_a(spawn_daemon, pool) as (on_a, on_b, conversation):
        runs = f"/v1/conversations/{conversation}/runs"
        first = await on_b.post(runs, json=body, headers=key)
        assert first.status_code == 202, first.text
        again = await on_a.post(runs, json=body, headers=key)
        assert again.status_code == 202, again.text
        assert again.headers.get("Idempotent-Replayed") == "true"
        assert again.json()["run_id"] == first.json()["run_id"]
        await wait_terminal(on_a, first.json()["run_id"], 30)
    assert await _models(pool, conversation) == ["demo"]


async def test_an_interrupt_built_on_a_stale_model_stops_the_running_turn_once_and_runs_on_the_new(
        spawn_daemon, pool):
    """`on_busy: interrupt` stops the conversation and queues the post in one transaction. A
    stale guess is refused when the conversation is locked, before the stop, and the post is
    built again on the row's model: the running turn is stopped, the new one runs on `demo`,
    nothing else is written."""
    async with _moved_behind_a(spawn_daemon, pool) as (on_a, on_b, conversation):
        runs = f"/v1/conversations/{conversation}/runs"
        long = await on_b.post(runs, json={"content": "long", "params": {
            "tokens": TOKENS, "delay_ms": DELAY_MS}})
        assert long.status_code == 202, long.text
        posted = await on_a.post(runs, json={"content": "instead", "params": {"tokens": 2},
                                             "on_busy": "interrupt"})
        assert posted.status_code == 202, posted.text
        stopped = await wait_terminal(on_a, long.json()["run_id"], 30)
        after = await wait_terminal(on_a, posted.json()["run_id"], 30)
    assert (stopped["status"], after["status"]) == ("cancelled", "completed")
    assert await _models(pool, conversation) == ["demo", "demo"]
