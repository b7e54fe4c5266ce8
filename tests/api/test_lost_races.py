"""A post that loses a race with other transactions runs again; one that keeps losing is a 503,
and so is any other request that loses one (api/errors.py), never a 500.

The database loses the race on purpose (tests/support/races.py): a trigger fails the turn's
insert (or, for any other request, the conversation's update) with PostgreSQL's multixact error
or a deadlock's, for as many attempts as it is told. Either way the statement wrote nothing, so
the post runs again (queue.lost_race).
"""

from __future__ import annotations

import pytest

from tests.api.conftest import Api
from tests.api.helpers import assert_error, db_state, start_run, wait_run
from tests.support.factories import create_conversation
from tests.support.races import DEADLOCK, MULTIXACT, lose_races, race_attempts, stop_losing_races


async def test_a_post_that_loses_one_race_is_written_once_and_runs(api: Api) -> None:
    conversation = await create_conversation(api.a)
    await lose_races(api.pool, times=1)
    run = await start_run(api.a, conversation, "after a lost race")
    assert await race_attempts(api.pool) == 2
    assert (await wait_run(api.a, run["run_id"]))["status"] == "completed"
    assert await api.pool.fetchval("SELECT count(*) FROM agent_run") == 1


async def test_a_post_that_keeps_losing_is_a_503_that_writes_nothing(api: Api) -> None:
    conversation = await create_conversation(api.a)
    await lose_races(api.pool, times=1_000)
    before = await db_state(api.pool)
    refused = await api.a.post(f"/v1/conversations/{conversation}/runs",
                               json={"content": "never written"},
                               headers={"Idempotency-Key": "lost"})
    error = assert_error(refused, 503, "unavailable")
    assert refused.headers["Retry-After"] == "1"
    assert "multixact" not in error["message"]  # no internals in what clients see
    assert await race_attempts(api.pool) == 3  # with the claim beside it, then twice without
    assert await db_state(api.pool) == before

    await stop_losing_races(api.pool)
    again = await api.a.post(f"/v1/conversations/{conversation}/runs",
                             json={"content": "now written"}, headers={"Idempotency-Key": "lost"})
    assert again.status_code == 202, again.text
    await wait_run(api.a, again.json()["run_id"])


@pytest.mark.parametrize("error", [MULTIXACT, DEADLOCK], ids=["multixact", "deadlock"])
async def test_any_request_that_loses_a_race_is_a_503_that_writes_nothing(
        api: Api, error: tuple[str, str]) -> None:
    conversation = await create_conversation(api.a, "before")
    await lose_races(api.pool, times=1, on="UPDATE ON conversation", error=error)
    before = await db_state(api.pool)
    refused = await api.a.patch(f"/v1/conversations/{conversation}", json={"title": "after"})
    body = assert_error(refused, 503, "unavailable")
    assert refused.headers["Retry-After"] == "1"
    assert "multixact" not in body["message"] and "deadlock" not in body["message"]
    assert await db_state(api.pool) == before
    assert (await api.a.get(f"/v1/conversations/{conversation}")).json()["title"] == "before"

    again = await api.a.patch(f"/v1/conversations/{conversation}", json={"title": "after"})
    assert again.status_code == 200, again.text  # the race lost once: sent again, it lands
    assert (await api.a.get(f"/v1/conversations/{conversation}")).json()["title"] == "after"
