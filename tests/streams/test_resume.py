"""A stream you can drop and rejoin (rule 7): a client that hangs up at random bytes — between
frames, mid-frame, right after the headers — and reconnects with the last id it saw gets every
event exactly once, in order, and reconstructs exactly the final message.

The run stream resumes by seq (`?from=N` and `Last-Event-ID`, alternately); the conversation
stream by its opaque cursor (`?cursor=` and `Last-Event-ID`, alternately) across queued turns.
A reader that rejoins after it got `complete` gets nothing more (never a second ending); a
terminal run whose journal lacks its `complete` gets exactly one, synthesized from the row.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from uuid import UUID

import httpx

from agentd.providers.demo import expected_answer
from agentd.vocabulary import EventType
from tests.streams.helpers import post_run, wait_terminal
from tests.support.factories import create_conversation, new_device
from tests.support.journal import assistant_message, read_journal
from tests.support.sse import Frame, as_journal, deltas, journal_rows, read_until_cut

SEED = 20_240_602
# A short flush clock makes hundreds of journal rows per run: hundreds of places to drop at.
DAEMON = {"flush_ms": 10}
RUN_TOKENS, RUN_DELAY_MS, PARALLEL_RUNS = 600, 5, 4
FEED_TOKENS, FEED_DELAY_MS, FEED_TURNS = 250, 5, 4
MIN_RUN_DISCONNECTS = 200
MIN_FEED_DISCONNECTS = 60
DEADLINE_S = 120.0


@dataclass
class Resumed:
    frames: list[Frame] = field(default_factory=list)
    connections: int = 0
    disconnects: int = 0
    mid_frame: int = 0
    by_header: int = 0
    by_query: int = 0


async def resume_run_stream(client: httpx.AsyncClient, run_id: str,
                            rng: random.Random) -> Resumed:
    """Follow one run to `complete`, hanging up at a random byte of every connection."""
    out = Resumed()
    last = 0
    while not out.frames or out.frames[-1].event != EventType.COMPLETE:
        out.connections += 1
        by_header = out.connections % 2 == 0
        budget = 0 if rng.random() < 0.05 else rng.randint(1, 500)
        cut = await read_until_cut(
            client, f"/v1/runs/{run_id}/events", budget=budget,
            params=None if by_header else {"from": last},
            headers={"Last-Event-ID": str(last)} if by_header else None)
        if not cut.cut:
            assert cut.frames and cut.frames[-1].event == EventType.COMPLETE, \
                f"the server ended a stream before `complete`: {cut.frames[-3:]}"
        for frame in cut.frames:
            assert frame.id == str(frame.seq) and frame.event == frame.data["type"], frame
            assert frame.seq > last, f"seq {frame.seq} after {last}: replayed or out of order"
            out.frames.append(frame)
            last = frame.seq
        if cut.cut and (not cut.frames or cut.frames[-1].event != EventType.COMPLETE):
            out.disconnects += 1
            out.mid_frame += cut.mid_frame
            if last:
                out.by_header += by_header
                out.by_query += not by_header
    # A client that got `complete` but dropped before it saw the stream end rejoins with the
    # complete's own id: it has everything, so the stream ends at once with nothing more.
    for by_header in (False, True):
        again = await read_until_cut(
            client, f"/v1/runs/{run_id}/events", budget=None,
            params=None if by_header else {"from": last},
            headers={"Last-Event-ID": str(last)} if by_header else None)
        assert again.frames == [], f"rejoining after `complete` sent {again.frames}"
    return out


async def test_run_stream_dropped_hundreds_of_times_reconstructs_the_exact_answer(
        spawn_daemon, pool):
    daemon = spawn_daemon(**DAEMON)
    await daemon.wait_ready()
    device = await new_device(pool, "a", "laptop")
    rng = random.Random(SEED)
    async with device.client(daemon) as client, asyncio.timeout(DEADLINE_S):
        prompts = [f"resume me, run {i}" for i in range(PARALLEL_RUNS)]
        conversations = [await create_conversation(client) for _ in prompts]
        runs = [(await post_run(client, conversation, prompt, tokens=RUN_TOKENS,
                                delay_ms=RUN_DELAY_MS))["run_id"]
                for conversation, prompt in zip(conversations, prompts, strict=True)]
        # The clients start while the runs stream: they hang up on live runs, not replays.
        resumed = await asyncio.gather(*(
            resume_run_stream(client, run_id, random.Random(rng.random())) for run_id in runs))
        finals = [await wait_terminal(client, run_id, 30) for run_id in runs]

    for run_id, prompt, got, final in zip(runs, prompts, resumed, finals, strict=True):
        seqs = [f.seq for f in got.frames]
        assert seqs == list(range(1, len(seqs) + 1)), f"gap or duplicate in run {run_id}: {seqs}"
        types = [f.event for f in got.frames]
        assert types[:3] == ["user_message", "run_queued", "run_started"], types[:3]
        assert types.count("complete") == 1 and types[-1] == "complete", types[-3:]
        # Exactly what the journal holds, event for event.
        assert as_journal(got.frames) == journal_rows(await read_journal(pool, run_id))

        text = deltas(got.frames)
        answer = expected_answer("demo", prompt, RUN_TOKENS)
        assert text == answer
        complete = got.frames[-1].data
        assert complete["status"] == "completed" and complete["error"] is None, complete
        stored = await assistant_message(pool, run_id)
        assert str(stored["id"]) == complete["message_id"]
        assert (stored["content"], stored["status"]) == (answer, "complete")
        assert final["status"] == "completed"

    disconnects = sum(r.disconnects for r in resumed)
    assert disconnects >= MIN_RUN_DISCONNECTS, [r.disconnects for r in resumed]
    assert sum(r.mid_frame for r in resumed) > 0, "never dropped in the middle of a frame"
    assert sum(r.by_header for r in resumed) > 0 and sum(r.by_query for r in resumed) > 0


async def test_conversation_stream_dropped_at_random_delivers_every_turn_exactly_once(
        spawn_daemon, pool):
    daemon = spawn_daemon(**DAEMON)
    await daemon.wait_ready()
    device = await new_device(pool, "a", "laptop")
    rng = random.Random(SEED + 1)
    got = Resumed()
    per_run: dict[str, list[Frame]] = defaultdict(list)
    async with device.client(daemon) as client, asyncio.timeout(DEADLINE_S):
        conversation = await create_conversation(client)
        path = f"/v1/conversations/{conversation}/events"

        # Attach before any turn exists; hang up right after the snapshot.
        first = await read_until_cut(client, path, budget=0, exempt_first=True)
        [snapshot] = first.frames
        assert snapshot.event == "snapshot" and snapshot.data["conversation"]["id"] == conversation
        assert snapshot.data["conversation"]["runs"] == []
        cursor = snapshot.id
        assert cursor

        prompts = [f"feed turn {i}" for i in range(FEED_TURNS)]
        runs = [(await post_run(client, conversation, prompt, tokens=FEED_TOKENS,
                                delay_ms=FEED_DELAY_MS))["run_id"] for prompt in prompts]

        completed: set[str] = set()
        while completed != set(runs):
            got.connections += 1
            by_header = got.connections % 2 == 0
            if rng.random() < 0.1:  # sometimes drop inside the snapshot itself
                budget, exempt = rng.randint(0, 300), False
            else:
                budget, exempt = rng.randint(1, 1500), True
            missing = set(runs) - completed

            def last_complete(frame: Frame, missing: set[str] = missing) -> bool:
                if frame.event == EventType.COMPLETE:
                    missing.discard(frame.run_id)
                return not missing

            cut = await read_until_cut(
                client, path, budget=budget, exempt_first=exempt,
                params=None if by_header else {"cursor": cursor},
                headers={"Last-Event-ID": cursor} if by_header else None,
                # The last turn's `complete` ends the reading: the stream itself never ends.
                until=last_complete)
            if cut.cut:
                got.disconnects += 1
                got.mid_frame += cut.mid_frame
            else:
                assert cut.satisfied, "the conversation stream ended on its own"
            if cut.frames:
                assert cut.frames[0].event == "snapshot", \
                    f"connection {got.connections} began with {cut.frames[0].event}"
                assert cut.frames[0].id == cursor, "the snapshot moved the cursor"
            for frame in cut.frames[1:]:
                assert frame.event != "snapshot", "a snapshot in the middle of a stream"
                if frame.journaled:
                    per_run[frame.run_id].append(frame)
                    if frame.event == EventType.COMPLETE:
                        completed.add(frame.run_id)
            if cut.frames:
                cursor = cut.frames[-1].id
        finals = [await wait_terminal(client, run_id, 30) for run_id in runs]

    assert set(per_run) == set(runs), "events of a run that is not this conversation's"
    for run_id, prompt, final in zip(runs, prompts, finals, strict=True):
        frames = per_run[run_id]
        seqs = [f.seq for f in frames]
        assert seqs == list(range(1, len(seqs) + 1)), f"gap or duplicate in run {run_id}: {seqs}"
        assert [f.event for f in frames].count("complete") == 1
        assert frames[-1].event == "complete" and frames[-1].data["status"] == "completed"
        assert as_journal(frames) == journal_rows(await read_journal(pool, run_id), run_id)
        assert deltas(frames) == expected_answer("demo", prompt, FEED_TOKENS)
        assert final["status"] == "completed"
    # The turns ran one at a time, in the order they were queued.
    started = [datetime.fromisoformat(final["started_at"]) for final in finals]
    ended = [datetime.fromisoformat(final["finished_at"]) for final in finals]
    assert all(ended[i] <= started[i + 1] for i in range(len(runs) - 1)), (started, ended)
    assert got.disconnects >= MIN_FEED_DISCONNECTS, got.disconnects
    assert got.mid_frame > 0


async def test_a_terminal_run_without_a_journaled_complete_gets_one_synthesized(
        spawn_daemon, pool):
    daemon = spawn_daemon(keepalive_s=1)  # a quiet tail re-checks the run row every second
    await daemon.wait_ready()
    device = await new_device(pool, "a", "laptop")
    async with device.client(daemon) as client, asyncio.timeout(DEADLINE_S):
        conversation = await create_conversation(client)
        run_id = (await post_run(client, conversation, "finalize dies", tokens=5))["run_id"]
        await wait_terminal(client, run_id, 30)
        # As if the finalize had flipped the status but died before journaling its ending.
        await pool.execute("DELETE FROM run_event WHERE run_id = $1 AND type = 'complete'",
                           UUID(run_id))
        rows = await read_journal(pool, run_id)
        last = rows[-1]["seq"]
        whole = await read_until_cut(client, f"/v1/runs/{run_id}/events", budget=None)
        rejoin = await read_until_cut(client, f"/v1/runs/{run_id}/events", budget=None,
                                      headers={"Last-Event-ID": str(last)})

    assert as_journal(whole.frames[:-1]) == journal_rows(rows)
    for frames in (whole.frames, rejoin.frames):
        end = frames[-1]
        assert (end.event, end.seq, end.id) == ("complete", last + 1, str(last + 1))
        assert end.data["status"] == "completed" and end.data["synthesized"] is True
    assert len(rejoin.frames) == 1
