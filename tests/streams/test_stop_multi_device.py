"""Stop is a state, a disconnect is not (rule 8). Device 2 stops a turn device 1 is streaming:
every stream — device 1's run stream and conversation stream, device 2's conversation stream —
ends the turn with `complete` status `cancelled`, and the partial answer is kept, equal to what
was streamed. Device 1 hanging up on a turn, on the other hand, stops nothing: it completes.
"""

from __future__ import annotations

import asyncio
import functools
import random

import httpx

from agentd.providers.demo import expected_answer
from tests.streams.helpers import get_conversation, get_run, post_run, wait_terminal
from tests.support.daemon import poll_until
from tests.support.factories import create_conversation, new_device
from tests.support.journal import assistant_message
from tests.support.sse import Follower, Frame, deltas, is_complete, of_run


async def lease_released(follower: Follower) -> bool:
    """The feed's latest word on ownership is that nobody holds the conversation."""
    leases = [f.data["lease"] for f in follower.frames if f.event == "lease"]
    return bool(leases) and leases[-1] is None


LONG_TOKENS, LONG_DELAY_MS = 2000, 10  # 20 s: it only ends early because it is stopped
SHORT_TOKENS, SHORT_DELAY_MS = 200, 10
STRESS_TOKENS, STRESS_RUNS = 5000, 10


async def test_stop_from_a_second_device_ends_every_stream_cancelled(spawn_daemon, pool):
    daemon = spawn_daemon()
    await daemon.wait_ready()
    laptop = await new_device(pool, "a", "laptop")
    phone = await new_device(pool, "a", "phone")
    async with laptop.client(daemon) as on_laptop, phone.client(daemon) as on_phone, \
            asyncio.timeout(120):
        conversation = await create_conversation(on_laptop)
        feed = f"/v1/conversations/{conversation}/events"
        async with Follower(on_laptop, feed, name="laptop feed") as laptop_feed, \
                Follower(on_phone, feed, name="phone feed") as phone_feed:
            run_id = (await post_run(on_laptop, conversation, "a long answer",
                                     tokens=LONG_TOKENS, delay_ms=LONG_DELAY_MS))["run_id"]
            queued = await post_run(on_laptop, conversation, "and then this", tokens=5)
            assert queued["status"] == "queued"
            async with Follower(on_laptop, f"/v1/runs/{run_id}/events",
                                name="laptop run stream") as laptop_run:
                await laptop_run.wait_for(
                    lambda f: f.event == "content_delta" and f.seq >= 6, 30, "a few deltas")
                stop = await on_phone.post(f"/v1/conversations/{conversation}/stop")
                assert stop.status_code == 202, stop.text
                stopped = stop.json()
                assert (stopped["flagged"], stopped["cancelled"]) == ([run_id],
                                                                      [queued["run_id"]])

                # The run stream ends by itself, on `complete`.
                await laptop_run.wait_ended(30)
                ends = {"laptop run stream": laptop_run.frames[-1]}
                for follower in (laptop_feed, phone_feed):
                    ends[follower.name] = await follower.wait_for(
                        is_complete(run_id), 30, "the turn's complete")
                    ends[f"{follower.name}, queued turn"] = await follower.wait_for(
                        is_complete(queued["run_id"]), 30, "the queued turn's complete")
                    # Ownership is pushed too: the turn held the conversation, then nobody.
                    owned = await follower.wait_for(
                        lambda f: f.event == "lease" and f.data["lease"] is not None, 30,
                        "the turn's lease")
                    assert owned.data["lease"]["run_id"] == run_id
                    assert owned.data["lease"]["device"] == "laptop"
                    assert owned.data["lease"]["worker_id"] == daemon.worker_id
                    await poll_until(functools.partial(lease_released, follower), 30,
                                     what=f"the lease released on {follower.name}")
            final = await get_run(on_phone, run_id)
            state = await get_conversation(on_phone, conversation)

    for name, end in ends.items():
        assert end.event == "complete" and end.data["status"] == "cancelled", (name, end)
        if "queued" not in name:
            assert end.data["error"] is None, (name, end)
    assert [f.event for f in laptop_run.frames].count("complete") == 1
    assert final["status"] == "cancelled" and final["cancel_requested"] is True

    # The queued turn never ran; its text is handed back as a draft, which the streams can
    # match to the turn's own user message.
    [draft] = stopped["drafts"]
    assert (draft["run_id"], draft["content"]) == (queued["run_id"], "and then this")
    for follower in (laptop_feed, phone_feed):
        events = of_run(follower.frames, queued["run_id"])
        assert [f.event for f in events] == ["user_message", "run_queued", "complete"]
        assert events[0].data["message_id"] == draft["message_id"]
    [as_draft] = [m for m in state["messages"] if m["run_id"] == queued["run_id"]]
    assert (as_draft["id"], as_draft["status"]) == (draft["message_id"], "draft")

    # The partial answer is kept, and it is exactly what every stream showed.
    partial = await assistant_message(pool, run_id)
    assert partial["status"] == "partial"
    assert ends["laptop run stream"].data["message_id"] == str(partial["id"])
    shown = {"laptop run stream": deltas(laptop_run.frames),
             "laptop feed": deltas(laptop_feed.frames, run_id),
             "phone feed": deltas(phone_feed.frames, run_id)}
    assert shown == dict.fromkeys(shown, partial["content"]), shown
    full = expected_answer("demo", "a long answer", LONG_TOKENS)
    assert partial["content"] and full.startswith(partial["content"])
    assert len(partial["content"]) < len(full), "the stop did not cut the answer short"
    [message] = [m for m in state["messages"] if m["role"] == "assistant"]
    assert (message["status"], message["content"]) == ("partial", partial["content"])
    assert state["runs"] == []


async def test_stops_at_random_moments_keep_exactly_the_streamed_partial(spawn_daemon, pool):
    """Wherever a stop lands — between flushes, mid-write — the kept partial answer is exactly
    what the stream showed, and the stream ends `cancelled`."""
    daemon = spawn_daemon(flush_ms=5)  # a journal write is nearly always in flight
    await daemon.wait_ready()
    laptop = await new_device(pool, "a", "laptop")
    phone = await new_device(pool, "a", "phone")
    rng = random.Random(8)

    async def stop_at_random(on_laptop: httpx.AsyncClient, on_phone: httpx.AsyncClient,
                             i: int, after: int) -> tuple[str, list[Frame]]:
        conversation = await create_conversation(on_laptop)
        run_id = (await post_run(on_laptop, conversation, f"stop me {i}", tokens=STRESS_TOKENS,
                                 delay_ms=1))["run_id"]
        async with Follower(on_laptop, f"/v1/runs/{run_id}/events", name=f"run {i}") as run:
            await run.wait_for(lambda f: f.event == "content_delta" and f.seq >= after, 30,
                               f"delta {after}")
            stop = await on_phone.post(f"/v1/conversations/{conversation}/stop")
            assert stop.status_code == 202 and stop.json()["flagged"] == [run_id], stop.text
            await run.wait_ended(30)
        return run_id, run.frames

    async with laptop.client(daemon) as on_laptop, phone.client(daemon) as on_phone, \
            asyncio.timeout(120):
        results = await asyncio.gather(*(
            stop_at_random(on_laptop, on_phone, i, rng.randint(4, 60))
            for i in range(STRESS_RUNS)))
    for run_id, frames in results:
        end = frames[-1]
        assert (end.event, end.data["status"]) == ("complete", "cancelled"), end
        partial = await assistant_message(pool, run_id)
        assert partial["status"] == "partial" and str(partial["id"]) == end.data["message_id"]
        assert partial["content"] == deltas(frames), run_id


async def test_closing_every_stream_of_a_turn_does_not_cancel_it(spawn_daemon, pool):
    daemon = spawn_daemon()
    await daemon.wait_ready()
    laptop = await new_device(pool, "a", "laptop")
    async with laptop.client(daemon) as client, asyncio.timeout(120):
        conversation = await create_conversation(client)
        async with Follower(client, f"/v1/conversations/{conversation}/events",
                            name="laptop feed") as feed:
            run_id = (await post_run(client, conversation, "keep going", tokens=SHORT_TOKENS,
                                     delay_ms=SHORT_DELAY_MS))["run_id"]
            async with Follower(client, f"/v1/runs/{run_id}/events",
                                name="laptop run stream") as stream:
                await stream.wait_for(lambda f: f.event == "content_delta", 30, "a delta")
            await feed.wait_for(lambda f: f.event == "content_delta", 30, "a delta")
        # Both streams are gone (the lid closed) while the turn is still running.
        assert not stream.ended and not feed.ended
        assert (await get_run(client, run_id))["status"] == "running"

        final = await wait_terminal(client, run_id, 60)
    assert final["status"] == "completed" and final["cancel_requested"] is False
    answer = await assistant_message(pool, run_id)
    assert (answer["content"], answer["status"]) == (
        expected_answer("demo", "keep going", SHORT_TOKENS), "complete")
