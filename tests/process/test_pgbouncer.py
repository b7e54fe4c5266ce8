"""The fleet on real infrastructure: the pool's DSN through a real PgBouncer in transaction mode.

With `pooler = transaction` and the hub on a direct DSN, turns run end to end (many at once, so
consecutive statements really land on different server sessions). With the hub's DSN through
the pooler too, LISTEN connects and hears nothing: agentd says so in its log and /readyz, and
still finishes turns at the poll interval.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from agentd import db as dbmod
from agentd.hub import DEAF_MESSAGE
from agentd.vocabulary import RunStatus
from tests.process.helpers import wait_status
from tests.process.test_cli import agentd
from tests.streams.helpers import post_run
from tests.support.daemon import free_port, poll_until
from tests.support.factories import (
    create_conversation,
    enqueue_demo,
    new_account,
    new_conversation,
    new_device,
)
from tests.support.journal import (
    assert_journal_sound,
    assistant_messages,
    streamed_text,
)
from tests.support.pgbouncer import Bouncer
from tests.support.sse import deltas, read_until_cut

TURNS = 24


@pytest.fixture
def bouncer(dsn: str, tmp_path: Path) -> Iterator[Bouncer]:
    bouncer = Bouncer(dsn, tmp_path / "pgbouncer").start()
    try:
        yield bouncer
    finally:
        bouncer.close()


async def bouncer_answers(bouncer: Bouncer) -> None:
    async def answers() -> bool:
        try:
            conn = await asyncpg.connect(bouncer.dsn(), statement_cache_size=0, timeout=2)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            assert bouncer.proc is not None and bouncer.proc.poll() is None, \
                bouncer.log_text()
            return False
        await conn.close()
        return True

    await poll_until(answers, 15, interval=0.05, what="pgbouncer to answer")


async def test_turns_run_end_to_end_with_the_pool_through_pgbouncer_in_transaction_mode(
        spawn_daemon, pool, dsn, bouncer):
    await bouncer_answers(bouncer)
    daemon = spawn_daemon(dsn=bouncer.dsn(), hub_dsn=dsn, pooler="transaction", max_runs=8,
                          pool_max=4)
    body = await daemon.wait_ready()
    assert body["hub"] is True and "hub_problem" not in body

    # Many turns at once: statements of one daemon interleave over PgBouncer's server sessions.
    account = await new_account(pool)
    turns = [await enqueue_demo(pool, account, await new_conversation(pool, account), f"pb{n}",
                                tokens=30, delay_ms=2) for n in range(TURNS)]
    for turn in turns:
        await wait_status(pool, turn.run_id, RunStatus.COMPLETED, timeout=60)
        journal = await assert_journal_sound(pool, turn.run_id)
        assert streamed_text(journal) == turn.expected
        [answer] = await assistant_messages(pool, turn.run_id)
        assert answer["content"] == turn.expected

    # The HTTP API end to end through the pooler: create, post a turn, stream it whole.
    device = await new_device(pool, "bouncer", "laptop")
    async with device.client(daemon) as client:
        conversation = await create_conversation(client)
        run = await post_run(client, conversation, "through the pooler", tokens=20)
        cut = await read_until_cut(client, f"/v1/runs/{run['run_id']}/events", budget=None)
    [answer] = await assistant_messages(pool, run["run_id"])
    assert deltas(cut.frames) == answer["content"] != ""

    # The daemon's pool really went through PgBouncer (its log records every client login).
    database = dsn.rpartition("/")[2].split("?")[0]
    assert f"login attempt: db={database}" in bouncer.log_text()


async def test_a_hub_behind_the_pooler_hears_nothing_says_so_and_turns_still_finish(
        spawn_daemon, pool, bouncer):
    await bouncer_answers(bouncer)
    through = bouncer.dsn()
    daemon = spawn_daemon(dsn=through, hub_dsn=through, pooler="transaction", tick_s=0.5)
    await daemon.wait_for_log("receives no notifications", 30)
    body = await daemon.wait_ready()
    assert body["status"] == "ready"  # it works, at the poll interval …
    assert body["hub_notifications"] is False and body["hub_problem"] == DEAF_MESSAGE

    account = await new_account(pool)
    turn = await enqueue_demo(pool, account, await new_conversation(pool, account), "deaf",
                              tokens=10)
    await wait_status(pool, turn.run_id, RunStatus.COMPLETED, timeout=30)
    [answer] = await assistant_messages(pool, turn.run_id)
    assert answer["content"] == turn.expected


async def test_the_pool_sends_nothing_a_transaction_pooler_cannot_keep(bouncer):
    await bouncer_answers(bouncer)
    pool = await dbmod.create_pool(bouncer.dsn(), min_size=1, max_size=4, pooled=True)
    try:
        # Concurrent statements over few server sessions: no named statement to go missing.
        results = await asyncio.gather(*(pool.fetchval("SELECT $1::int + 1", n)
                                         for n in range(200)))
        assert results == [n + 1 for n in range(200)]
    finally:
        await pool.close()


async def test_doctor_goes_through_the_pooler_as_the_daemon_would_and_says_so(dsn, bouncer):
    """`agentd doctor` reaches the pool's DSN through PgBouncer set up as the daemon's pool is,
    runs migrations' check on the direct DSN, and names the pooler; told nothing of a pooler,
    it still answers in one line per check, and never a traceback."""
    await bouncer_answers(bouncer)
    listen = f"127.0.0.1:{free_port()}"
    told = agentd("doctor", env={"AGENTD_DSN": bouncer.dsn(), "AGENTD_HUB_DSN": dsn,
                                 "AGENTD_POOLER": "transaction", "AGENTD_LISTEN": listen})
    assert told.returncode == 0, told.stdout + told.stderr
    assert "[ok  ] pool: through a transaction pooler (pooler = transaction)" in told.stdout
    assert "[ok  ] listen/notify: round trip ok" in told.stdout
    assert "[ok  ] migrations: up to date" in told.stdout
    deaf = agentd("doctor", env={"AGENTD_DSN": bouncer.dsn(), "AGENTD_LISTEN": listen})
    assert "Traceback" not in deaf.stdout + deaf.stderr
    assert "[FAIL] listen/notify: no NOTIFY received" in deaf.stdout
