"""A conversation feed's cursor is the client's to send back, so nothing in it may widen what
the feed shows: a run it names that is not one of the conversation's — another account's run,
executing in the same process, whose newest rows that process holds — is dropped, never
streamed. (A cursor that is not one this server could have issued is a 400:
tests/api/test_endpoints.py.)
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from uuid import UUID

from tests.streams.helpers import post_run
from tests.support.factories import create_conversation, new_device
from tests.support.sse import Follower, Frame, of_run

LONG_TOKENS, LONG_DELAY_MS = 2000, 10  # 20 s: stopped once the test has seen enough
MORE_DELTAS = 30  # the other account's deltas streamed while the crafted feed is attached


def crafted_cursor(open_runs: dict[str, object]) -> str:
    """A cursor as this server encodes one (tail.FeedCursor), naming the runs given."""
    raw = {"w": [datetime.now(UTC).isoformat(), str(UUID(int=0))], "o": open_runs}
    return base64.urlsafe_b64encode(json.dumps(raw).encode()).decode().rstrip("=")


def open_runs_of(frame: Frame) -> set[str]:
    assert frame.id is not None
    raw = json.loads(base64.urlsafe_b64decode(frame.id + "=" * (-len(frame.id) % 4)))
    return set(raw["o"])


async def test_a_cursor_naming_another_accounts_run_streams_none_of_it(spawn_daemon, pool):
    daemon = spawn_daemon()
    await daemon.wait_ready()
    alice = await new_device(pool, "alice", "laptop")
    bob = await new_device(pool, "bob", "laptop")
    async with alice.client(daemon) as as_alice, bob.client(daemon) as as_bob:
        own = await create_conversation(as_alice)
        theirs = await create_conversation(as_bob)
        run_id = (await post_run(as_bob, theirs, "a long answer", tokens=LONG_TOKENS,
                                 delay_ms=LONG_DELAY_MS))["run_id"]
        async with Follower(as_bob, f"/v1/runs/{run_id}/events", name="bob's run") as bobs:
            await bobs.wait_for(lambda f: f.event == "content_delta" and f.seq >= 6, 30,
                                "a few deltas")
            # A position inside the rows the daemon holds for Bob's run, so that a feed that
            # followed it would be served from them rather than from a read of the database.
            at = await pool.fetchval("SELECT max(seq) FROM run_event WHERE run_id = $1",
                                     UUID(run_id))
            cursor = crafted_cursor({run_id: at})
            async with Follower(as_alice, f"/v1/conversations/{own}/events",
                                params={"cursor": cursor}, name="alice's feed") as feed:
                snapshot = await feed.wait_for(lambda f: f.event == "snapshot", 30,
                                               "the snapshot")
                # Bob's turn goes on streaming while Alice's feed is attached.
                await bobs.wait_for(lambda f: f.event == "content_delta"
                                    and f.seq >= at + MORE_DELTAS, 30, "more deltas")
                # A keepalive or any later frame carries the feed's cursor as it is now.
                stop = await as_bob.post(f"/v1/conversations/{theirs}/stop")
                assert stop.status_code == 202, stop.text
                await bobs.wait_ended(30)
            frames = feed.frames
    assert of_run(frames, run_id) == [], "another account's run reached this feed"
    assert not any(run_id in json.dumps(f.data) for f in frames)
    assert snapshot.data["conversation"]["runs"] == []
    for frame in frames[1:]:
        assert run_id not in open_runs_of(frame)

