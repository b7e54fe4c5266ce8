"""A database that takes no more connections, as a server at max_connections answers: every
request meets a 503 it may retry, never a 500, and the daemon comes back when it takes them
again."""

from __future__ import annotations

from tests.support.daemon import ADMIT_ANY_LOAD, SpawnDaemon, poll_until
from tests.support.factories import new_device
from tests.support.lost_answers import relayed

TOO_MANY = ("53300", "sorry, too many clients already")


async def test_a_server_at_its_connection_limit_is_a_503_not_a_500(
        spawn_daemon: SpawnDaemon, pool, dsn: str) -> None:
    """asyncpg raises TooManyConnectionsError when a pool grows (or reconnects) into a server
    with no connection left, as on a server several fleets share. It was answered 500
    `internal` with a traceback in the log, and agenttui does not retry a 500."""
    async with relayed(spawn_daemon, dsn, **ADMIT_ANY_LOAD) as (relay, daemon):
        device = await new_device(pool, "alice", "laptop")
        async with device.client(daemon) as client:
            assert (await client.get("/v1/me")).status_code == 200
            relay.refuse_new(*TOO_MANY)
            # The daemon's pool connections end: each must be made again, and is refused.
            ended = await pool.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = 'agentd' AND pid = ANY($1::int[])",
                list(relay.backend_pids))
            assert ended >= 1
            answers = [await client.get("/v1/me"), await client.get("/v1/conversations"),
                       await client.post("/v1/conversations", json={"title": "t"})]
            assert relay.refused >= 1, "no request had to connect: the test proves nothing"
            for answer in answers:
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "unavailable"
                assert answer.headers["Retry-After"] == "1"
            relay.refuse_new(None)

            async def served() -> bool:
                return (await client.get("/v1/me")).status_code == 200

            await poll_until(served, 15, interval=0.2, what="the daemon to come back")
        assert "unhandled error" not in daemon.log_text()
