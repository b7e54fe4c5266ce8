"""A post that loses a race with other transactions runs again; one that keeps losing is a 503,
and so is any other request that loses one (api/errors.py), never a 500.

PostgreSQL fails a statement for a race in two ways the daemon knows: as a deadlock's victim,
and with the internal error "new multixact has more than one updating member" (seen on
PostgreSQL 18 when a rival transaction had just undone an update of a row both locked;
tests/integration/test_no_write_undone.py). Either way the statement wrote nothing, so the post
runs again (queue.lost_race). Here the database loses the race on purpose: a trigger fails the
turn's insert (or, for any other request, the conversation's update) with that very error or a
deadlock's, for as many attempts as a sequence allows (a sequence, not a table, because the
failing statement rolls back whatever it wrote).
"""

from __future__ import annotations

import asyncpg
import pytest

from tests.api.conftest import Api
from tests.api.helpers import assert_error, db_state, start_run, wait_run
from tests.support.factories import create_conversation

_MULTIXACT = ("'new multixact has more than one updating member: 7 members'", "XX000")
_DEADLOCK = ("'deadlock detected'", "40P01")


async def _lose_races(pool: asyncpg.Pool, times: int, *, on: str = "INSERT ON agent_run",
                      error: tuple[str, str] = _MULTIXACT) -> None:
    message, code = error
    await pool.execute(f"""
        CREATE SEQUENCE lost_races;
        CREATE FUNCTION lose_a_race() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF nextval('lost_races') <= {times} THEN
                RAISE EXCEPTION {message} USING ERRCODE = '{code}';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER lose_a_race BEFORE {on} FOR EACH ROW EXECUTE FUNCTION lose_a_race();
    """)


async def _attempts(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT last_value FROM lost_races")


async def test_a_post_that_loses_one_race_is_written_once_and_runs(api: Api) -> None:
    conversation = await create_conversation(api.a)
    await _lose_races(api.pool, times=1)
    run = await start_run(api.a, conversation, "after a lost race")
    assert await _attempts(api.pool) == 2
    assert (await wait_run(api.a, run["run_id"]))["status"] == "completed"
    assert await api.pool.fetchval("SELECT count(*) FROM agent_run") == 1


async def test_a_post_that_keeps_losing_is_a_503_that_writes_nothing(api: Api) -> None:
    conversation = await create_conversation(api.a)
    await _lose_races(api.pool, times=1_000)
    before = await db_state(api.pool)
    refused = await api.a.post(f"/v1/conversations/{conversation}/runs",
                               json={"content": "never written"},
                               headers={"Idempotency-Key": "lost"})
    error = assert_error(refused, 503, "unavailable")
    assert refused.headers["Retry-After"] == "1"
    assert "multixact" not in error["message"]  # no internals in what clients see
    assert await _attempts(api.pool) == 3  # with the claim beside it, then twice without
    assert await db_state(api.pool) == before

    await api.pool.execute("DROP TRIGGER lose_a_race ON agent_run")
    again = await api.a.post(f"/v1/conversations/{conversation}/runs",
                             json={"content": "now written"}, headers={"Idempotency-Key": "lost"})
    assert again.status_code == 202, again.text
    await wait_run(api.a, again.json()["run_id"])


@pytest.mark.parametrize("error", [_MULTIXACT, _DEADLOCK], ids=["multixact", "deadlock"])
async def test_any_request_that_loses_a_race_is_a_503_that_writes_nothing(
        api: Api, error: tuple[str, str]) -> None:
    conversation = await create_conversation(api.a, "before")
    await _lose_races(api.pool, times=1, on="UPDATE ON conversation", error=error)
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
