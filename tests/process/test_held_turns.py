"""A queued turn held back starts as soon as what held it ends, without waiting for the claim
loop's poll: held by its conversation's running turn, by its account's running limit (also when
two turns end together) or by the daemon's slots. The ending's wake goes to the daemon's own
claim loop alone (notifier.py), which has just got that turn's slot back. The daemon's poll is
an hour away throughout, so a turn that waited for it would never start within the test.
"""

from __future__ import annotations

from uuid import UUID

from agentd.accounts import LimitChange, set_account_limits
from tests.process.helpers import wait_status
from tests.support.factories import create_conversation, new_device

LONG = {"tokens": 10, "delay_ms": 100}  # about a second: the held turn is posted meanwhile
SHORT = {"tokens": 2, "delay_ms": 0}


async def post_turn(client, conversation: str, params: dict[str, int]) -> dict:
    response = await client.post(f"/v1/conversations/{conversation}/runs",
                                 json={"content": "go", "params": params})
    assert response.status_code == 202, response.text
    return response.json()


async def held_then_started(pool, client, holders: list[dict], conversation: str) -> None:
    """Post a turn while `holders` run: it must be queued, then run once they have ended."""
    held = await post_turn(client, conversation, SHORT)
    assert held["status"] == "queued", ("not held back: the turns holding it ended too soon",
                                        held)
    for holder in holders:
        await wait_status(pool, UUID(holder["run_id"]), "completed", timeout=30)
    row = await wait_status(pool, UUID(held["run_id"]), "completed", timeout=30)
    assert row["error"] is None


async def test_a_held_turn_starts_when_what_held_it_ends(spawn_daemon, pool):
    daemon = spawn_daemon(tick_s=3600, max_runs=2)
    await daemon.wait_ready()
    device = await new_device(pool, "held", "laptop")
    async with device.client(daemon) as client:
        one, two, three = [await create_conversation(client) for _ in range(3)]

        # Its conversation's turn runs.
        first = await post_turn(client, one, LONG)
        assert first["status"] == "running"
        await held_then_started(pool, client, [first], one)

        # Its account is at its running limit (here 1), with turns of other conversations.
        await set_account_limits(pool, "held", LimitChange(change_running=True, max_running=1))
        first = await post_turn(client, one, LONG)
        assert first["status"] == "running"
        await held_then_started(pool, client, [first], two)

        # The same at a limit of 2, the two running turns ending together (most often in one
        # terminal write): after both, nothing runs.
        await set_account_limits(pool, "held", LimitChange(change_running=True, max_running=2))
        first, second = [await post_turn(client, c, LONG) for c in (one, two)]
        assert (first["status"], second["status"]) == ("running", "running")
        await held_then_started(pool, client, [first, second], three)

        # The daemon's slots are all taken (max_runs 2), the account far below its limit.
        await set_account_limits(pool, "held", LimitChange(change_running=True, max_running=None))
        first, second = [await post_turn(client, c, LONG) for c in (one, two)]
        assert (first["status"], second["status"]) == ("running", "running")
        await held_then_started(pool, client, [first, second], three)
