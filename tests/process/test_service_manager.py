"""What a service manager sees of one `agentd serve`: READY=1 once it serves, and at a stop
STOPPING=1 with how long the drain may take (so systemd's own stop timeout does not cut a longer
drain short). SIGHUP (a closed terminal) drains as SIGTERM does rather than kill turns mid-way;
under nohup it stays ignored.
"""

from __future__ import annotations

import signal

import pytest

from agentd.migrate import MIGRATION_LOCK_KEY
from agentd.vocabulary import RunStatus
from tests.process.helpers import wait_status
from tests.support.daemon import Daemon, launch, tracked_daemons
from tests.support.factories import enqueue_demo, new_account, new_conversation
from tests.support.journal import assistant_messages, run_row
from tests.support.notify import notify_socket


async def test_ready_then_a_stop_that_asks_for_its_drain_budget(spawn_daemon):
    with notify_socket() as notify:
        daemon = spawn_daemon(drain_s=90, env=notify.env)
        await notify.wait_for("READY", 60)
        assert (await daemon.readyz())["status"] == "ready"
        daemon.terminate()
        assert await daemon.wait_exit(30) == 0
        stop = await notify.wait_for("STOPPING", 5)
    assert int(stop["EXTEND_TIMEOUT_USEC"]) >= 90_000_000


async def test_sighup_drains_the_turn_in_flight_and_exits_zero(spawn_daemon, pool):
    daemon = spawn_daemon(drain_s=20)
    await daemon.wait_ready()
    account = await new_account(pool)
    turn = await enqueue_demo(pool, account, await new_conversation(pool, account), "hup",
                              tokens=40, delay_ms=25)  # ~1 s
    await wait_status(pool, turn.run_id, RunStatus.RUNNING, timeout=20)

    daemon.send_signal(signal.SIGHUP)
    assert await daemon.wait_exit(30) == 0
    row = await run_row(pool, turn.run_id)
    assert row["status"] == RunStatus.COMPLETED, row["error"]
    [answer] = await assistant_messages(pool, turn.run_id)
    assert answer["content"] == turn.expected


class NohupDaemon(Daemon):
    """`nohup agentd serve`: started with SIGHUP ignored."""

    def command(self) -> list[str]:
        return ["nohup", *super().command()]


async def test_under_nohup_sighup_stays_ignored(request, dsn, tmp_path, pool):
    daemon = launch(tracked_daemons(request), NohupDaemon, dsn=dsn, tmp_path=tmp_path,
                    name="nohup", env=None, args=(), settings={})
    await daemon.wait_ready()
    daemon.send_signal(signal.SIGHUP)
    # Still claiming (a drain would have stopped that at once), and still serving.
    account = await new_account(pool)
    turn = await enqueue_demo(pool, account, await new_conversation(pool, account), "still",
                              tokens=3)
    await wait_status(pool, turn.run_id, RunStatus.COMPLETED, timeout=20)
    assert (await daemon.readyz())["status"] == "ready"
    assert "drained" not in daemon.log_text()


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_stop_while_waiting_for_another_migration_ends_the_start(
        spawn_daemon, pool, workers: int):
    """Another process holds the migration lock (a long migration elsewhere in the fleet): the
    start says it waits, and SIGTERM ends it cleanly. Before, the signal was only noticed once
    the daemon served, so nothing but SIGKILL stopped it."""
    async with pool.acquire() as holder:
        await holder.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        try:
            daemon = spawn_daemon(workers=workers)
            await daemon.wait_for_log("waiting for another process's migration", 30)
            daemon.terminate()
            assert await daemon.wait_exit(15) == 0
            assert "stopped while waiting to migrate the database" in daemon.log_text()
        finally:
            await holder.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
