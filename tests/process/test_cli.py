"""`agentd` commands as scripts drive them: output, exit codes and errors that name the fix."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
import pytest

from agentd.accounts import authenticate
from agentd.embedded_pg.server import _LOCK_NAME
from agentd.migrate import discover, migrate, pending
from tests.support.daemon import free_port
from tests.support.db import with_database


def agentd(*args: str, env: dict[str, str] | None = None,
           home: Path | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    if home is not None:
        clean["XDG_CONFIG_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "agentd", *args], capture_output=True,
                          text=True, timeout=120, env={**clean, **(env or {})}, check=False)


async def test_token_create_list_revoke(dsn: str, pool: asyncpg.Pool) -> None:
    created = agentd("token", "create", "--dsn", dsn, "--account", "acme", "--device", "ci")
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert created.stdout == token + "\n"  # the token alone: `TOKEN=$(agentd token create …)`
    who = await authenticate(pool, token)
    assert who is not None and (who.account_name, who.device_name) == ("acme", "ci")
    stored = await pool.fetchval("SELECT count(*) FROM device WHERE token_hash = "
                                 "sha256(convert_to($1, 'UTF8'))", token)
    assert stored == 1  # found by hash: the token itself is nowhere in the database
    assert not await pool.fetchval("SELECT count(*) FROM device WHERE "
                                   "encode(token_hash, 'escape') LIKE '%' || $1 || '%'", token)

    listing = agentd("token", "list", "--dsn", dsn)
    assert listing.returncode == 0 and str(who.device_id) in listing.stdout
    assert token not in listing.stdout and "active" in listing.stdout

    revoked = agentd("token", "revoke", "--dsn", dsn, str(who.device_id))
    assert revoked.returncode == 0, revoked.stderr
    assert await authenticate(pool, token) is None
    again = agentd("token", "revoke", "--dsn", dsn, str(who.device_id))
    # Asked again (the first answer lost): said so, and not an error.
    assert again.returncode == 0 and "was already revoked" in again.stdout, again.stderr
    bad = agentd("token", "revoke", "--dsn", dsn, "not-a-uuid")
    assert bad.returncode == 2 and "not a device id" in bad.stderr


async def test_migrate_status_and_doctor(dsn: str) -> None:
    migrated = agentd("migrate", "--dsn", dsn)
    assert migrated.returncode == 0 and "up to date" in migrated.stdout
    status = agentd("status", "--dsn", dsn)
    assert status.returncode == 0, status.stderr
    assert "queued: 0" in status.stdout and "running: 0" in status.stdout
    doctor = agentd("doctor", "--dsn", dsn, env={"AGENTD_LISTEN": f"127.0.0.1:{free_port()}"})
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "[ok  ] listen/notify: round trip ok" in doctor.stdout
    assert "[ok  ] pool: direct (pooler = none)" in doctor.stdout


async def test_read_commands_apply_no_migration(pg_admin_dsn: str, tmp_path: Path) -> None:
    """`status`, `token list` and `account show` only read: on a schema that lacks migrations
    they say to run `agentd migrate` and change nothing. They used to apply every pending
    migration, DDL on a fleet's database from a monitoring script. A command that writes
    still brings the schema up to date."""
    name = f"agentd_reads_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        dsn = with_database(pg_admin_dsn, name)
        reads = (["status"], ["status", "--json"], ["token", "list"], ["account", "show"])
        for args in reads:
            result = agentd(*args, "--dsn", dsn)
            assert result.returncode == 1, result.stdout + result.stderr
            assert "holds no agentd schema yet" in result.stderr
            assert "agentd migrate" in result.stderr and "Traceback" not in result.stderr
        conn = await asyncpg.connect(dsn)
        try:
            assert await conn.fetchval("SELECT count(*) FROM pg_class c JOIN pg_namespace n"
                                       " ON n.oid = c.relnamespace"
                                       " WHERE n.nspname = 'public'") == 0
            # One migration behind, as a fleet is while a newer agentd rolls out.
            *older, newest = discover()
            behind = tmp_path / "sql"
            behind.mkdir()
            for migration in older:
                (behind / f"{migration.name}.sql").write_text(migration.sql)
            await migrate(conn, behind)
            for args in reads:
                result = agentd(*args, "--dsn", dsn)
                assert result.returncode == 1, result.stdout + result.stderr
                assert f"lacks 1 migration of this agentd (from {newest.name})" in result.stderr
            assert await pending(conn) == [newest.name]

            created = agentd("token", "create", "--dsn", dsn, "--account", "a", "--device", "d")
            assert created.returncode == 0, created.stderr
            assert await pending(conn) == []
            assert agentd("status", "--dsn", dsn).returncode == 0
        finally:
            await conn.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def test_doctor_reports_a_database_it_cannot_reach_and_checks_the_rest() -> None:
    """With --dsn nothing connects before the database check: an unreachable server is a FAIL
    line of the report, and the checks that do not need it (the port, TLS) still run. It was
    one `cannot reach the database` line, the report thrown away."""
    down = f"postgresql://agentd@127.0.0.1:{free_port()}/agentd"
    doctor = agentd("doctor", "--dsn", down, env={"AGENTD_LISTEN": f"127.0.0.1:{free_port()}"})
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "[ok  ] python:" in doctor.stdout
    assert "[FAIL] database: cannot connect:" in doctor.stdout
    assert "[ok  ] listen address:" in doctor.stdout and "[ok  ] tls:" in doctor.stdout
    assert "Traceback" not in doctor.stdout + doctor.stderr


def test_invalid_settings_fail_naming_the_key() -> None:
    result = agentd("status", env={"AGENTD_LEASE_TTL_S": "soon"})
    assert result.returncode == 2
    assert "lease_ttl_s" in result.stderr and "AGENTD_LEASE_TTL_S" in result.stderr
    result = agentd("serve", "--listen", "nowhere")
    assert result.returncode == 2 and "listen" in result.stderr
    # A default model no provider offers would refuse every run that names none: serve stops
    # at once (it started before), and doctor fails on it (it passed before).
    down = f"postgresql://nobody@127.0.0.1:{free_port()}/none"  # never reached
    for typo, said in (("opnai:gpt-4o", "unknown model provider 'opnai'"),
                       ("demo:other", "'demo:other' is not a model provider 'demo' offers")):
        result = agentd("serve", "--dsn", down, env={"AGENTD_DEFAULT_MODEL": typo})
        assert result.returncode == 2, result.stderr
        assert "default_model (AGENTD_DEFAULT_MODEL)" in result.stderr and said in result.stderr
        assert "cannot reach the database" not in result.stderr  # nothing was started
        doctor = agentd("doctor", "--dsn", down, env={"AGENTD_DEFAULT_MODEL": typo})
        said_by_doctor = doctor.stdout.replace('"', "'")
        assert f"[FAIL] provider default_model: {said}" in said_by_doctor, doctor.stdout


def test_unreachable_database_is_a_clear_error() -> None:
    port = free_port()
    result = agentd("status", "--dsn", f"postgresql://nobody@127.0.0.1:{port}/none")
    assert result.returncode == 1
    assert "cannot reach the database" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_embedded_server_that_cannot_start_is_exit_1(tmp_path: Path) -> None:
    """A database that cannot be had is exit 1, whether a server is unreachable or the
    embedded one cannot start (it was 2, the code for a malformed value)."""
    data_dir = tmp_path / "data"
    (data_dir / _LOCK_NAME).mkdir(parents=True)  # the start lock cannot be opened
    result = agentd("status", "--data-dir", str(data_dir))
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("cannot open the lock file") == 1, result.stderr  # said once
    assert "--dsn" in result.stderr
    assert "Traceback" not in result.stderr


async def test_serve_on_a_busy_address_names_it_and_its_holder_and_touches_nothing(
        pg_admin_dsn: str, tmp_path: Path) -> None:
    empty = f"agentd_busy_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{empty}"')
        home = tmp_path / "home"
        env = {f"XDG_{name.upper()}_HOME": str(home / name)
               for name in ("config", "data", "state", "cache")}
        data_dir = tmp_path / "pg"
        with socket.socket() as holder:  # this process holds the port
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            listen = f"127.0.0.1:{holder.getsockname()[1]}"
            for where in (["--dsn", with_database(pg_admin_dsn, empty)],
                          ["--data-dir", str(data_dir)]):
                result = agentd("serve", "--listen", listen, *where, env=env)
                assert result.returncode == 1, result.stderr
                program = sys.orig_argv[0]  # as this process's command line shows it
                assert f"cannot listen on {listen}: the address is already in use by " \
                       f"pid {os.getpid()} ({program}" in result.stderr, result.stderr
                assert "--listen" in result.stderr
                assert "database" not in result.stderr and "Traceback" not in result.stderr
        # Nothing was touched: no migration, no embedded cluster, no file written.
        conn = await asyncpg.connect(with_database(pg_admin_dsn, empty))
        try:
            assert await conn.fetchval("SELECT count(*) FROM pg_class c JOIN pg_namespace n"
                                       " ON n.oid = c.relnamespace"
                                       " WHERE n.nspname = 'public'") == 0
        finally:
            await conn.close()
        assert not data_dir.exists()
        assert not home.exists() or not [p for p in home.rglob("*") if p.is_file()]
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{empty}" WITH (FORCE)')
        await admin.close()


def test_install_service_writes_a_hardened_unit_without_secrets(tmp_path: Path) -> None:
    secret_dsn = "postgresql://agentd:s3cret-pw@db.internal/agentd"
    data = tmp_path / "data dir"
    result = agentd("install-service", "--no-enable", "--", "--dsn", secret_dsn,
                    "--data-dir", str(data), "--listen", "0.0.0.0:8740", home=tmp_path,
                    env={"OPENAI_API_KEY": "sk-test-key-123", "AGENTD_MAX_RUNS": "4"})
    assert result.returncode == 0, result.stderr
    unit_path = tmp_path / "systemd" / "user" / "agentd.service"
    unit = unit_path.read_text()
    for secret in ("s3cret-pw", "sk-test-key-123", secret_dsn):
        assert secret not in unit and secret not in result.stdout + result.stderr
    assert "Type=notify" in unit
    command = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert command.endswith(f"-m agentd serve --data-dir '{data}' --listen 0.0.0.0:8740")
    # Only agentd gets the stop's SIGTERM: its embedded PostgreSQL must outlive the drain.
    for line in ("NoNewPrivileges=yes", "PrivateTmp=yes", "ProtectSystem=strict",
                 "KillMode=mixed"):
        assert line in unit.splitlines(), line
    writable = next(line for line in unit.splitlines() if line.startswith("ReadWritePaths="))
    assert f'"{data}"' in writable  # the data directory (quoted: it holds a space)
    assert data.is_dir()

    env_path = tmp_path / "agentd" / "agentd.env"
    assert f"EnvironmentFile={env_path}" in unit
    assert stat.S_IMODE(env_path.stat().st_mode) == 0o600
    variables = dict(line.split("=", 1) for line in env_path.read_text().splitlines()
                     if line and not line.startswith("#"))
    assert variables.items() >= {"AGENTD_DSN": f'"{secret_dsn}"',
                                 "OPENAI_API_KEY": '"sk-test-key-123"',
                                 "AGENTD_MAX_RUNS": '"4"'}.items()
    # Nothing else but settings and the providers' keys (this machine may have some set).
    assert {k for k in variables if not k.startswith("AGENTD_")} <= {"OPENAI_API_KEY",
                                                                    "ANTHROPIC_API_KEY"}

    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: the unit was not verified by systemd")
    verified = subprocess.run([analyze, "verify", str(unit_path)], capture_output=True,
                              text=True, timeout=120, check=False)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "agentd.service" not in verified.stderr, verified.stderr  # no warning about it


def test_install_service_reads_serve_arguments_as_serve_does(tmp_path: Path) -> None:
    """A flag's value is found whatever way serve would read it (`--data-dir=…`), relative
    paths are made absolute (the unit runs elsewhere), an abbreviated flag is refused rather
    than written into the unit (`--ds` was `--dsn`, its password in ExecStart), and the local
    client's config directory exists for the unit to write its token into."""
    workdir = tmp_path / "here"
    workdir.mkdir()
    shell = subprocess.run  # in `workdir`, as a user's shell would be

    def install(*serve_args: str) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
        return shell([sys.executable, "-m", "agentd", "install-service", "--no-enable", "--",
                      *serve_args], capture_output=True, text=True, timeout=120, check=False,
                     cwd=workdir, env={**clean, "XDG_CONFIG_HOME": str(tmp_path)})

    unit_path = tmp_path / "systemd" / "user" / "agentd.service"
    refused = install("--ds", "postgresql://agentd:s3cret-pw@db.internal/agentd")
    assert refused.returncode == 2 and "--ds" in refused.stderr, refused.stderr
    assert not unit_path.exists()
    too_many = install("--workers", "999")
    assert too_many.returncode == 2 and "workers" in too_many.stderr, too_many.stderr
    assert not unit_path.exists()

    result = install("--data-dir=relative data")
    assert result.returncode == 0, result.stderr
    data = (workdir / "relative data").resolve()
    unit = unit_path.read_text()
    command = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert command.endswith(f"-m agentd serve '--data-dir={data}'"), command
    writable = next(line for line in unit.splitlines() if line.startswith("ReadWritePaths="))
    assert f'"{data}"' in writable and data.is_dir()
    client_dir = tmp_path / "agenttui"
    assert client_dir.is_dir() and stat.S_IMODE(client_dir.stat().st_mode) == 0o700
    assert f"-{client_dir}" in writable


def test_install_service_carries_every_secret_the_config_names(tmp_path: Path) -> None:
    """An MCP server's header values come from variables the config names: the service gets
    them as it gets the providers' keys (before, it never had them, and the server failed
    under systemd though it worked from the shell). A relative AGENTD_DATA_DIR is made
    absolute, as --data-dir is; a value an environment file cannot carry is one line, exit 2
    (it was a traceback)."""
    workdir = tmp_path / "here"
    workdir.mkdir()
    config = workdir / "agentd.toml"
    config.write_text('[providers.anthropic]\nenabled = false\n'
                      '[mcp.tracker]\nurl = "https://mcp.example.test/"\n'
                      '[mcp.tracker.headers]\nAuthorization = "TRACKER_AUTH"\n'
                      'X-Team = "TRACKER_TEAM"\n')
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("AGENTD_", "TRACKER_", "ANTHROPIC_"))}

    def install(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agentd", "install-service", "--no-enable", "--",
             "--config", "agentd.toml"], capture_output=True, text=True, timeout=120,
            check=False, cwd=workdir,
            env={**clean, "XDG_CONFIG_HOME": str(tmp_path), **env})

    # A unit that serve would refuse at every start is not written.
    refused = install(AGENTD_DEFAULT_MODEL="opnai:gpt-4o")
    assert refused.returncode == 2 and "default_model" in refused.stderr, refused.stderr
    assert not (tmp_path / "systemd" / "user" / "agentd.service").exists()

    result = install(TRACKER_AUTH="Bearer mcp-secret-1", AGENTD_DATA_DIR="state",
                     ANTHROPIC_API_KEY="sk-ant-test")
    assert result.returncode == 0, result.stderr
    env_text = (tmp_path / "agentd" / "agentd.env").read_text()
    assert 'TRACKER_AUTH="Bearer mcp-secret-1"' in env_text
    # A switched-off provider's key too: switched on later, it must find it.
    assert 'ANTHROPIC_API_KEY="sk-ant-test"' in env_text
    assert f'AGENTD_DATA_DIR="{(workdir / "state").resolve()}"' in env_text
    unit = (tmp_path / "systemd" / "user" / "agentd.service").read_text()
    assert "mcp-secret-1" not in unit and "mcp-secret-1" not in result.stdout + result.stderr
    # The one it names but this shell lacks is said, not silently left out.
    assert "TRACKER_TEAM" in result.stderr and "mcp" in result.stderr.lower()

    broken = install(TRACKER_AUTH="Bearer a\nb")
    assert broken.returncode == 2, broken.stderr
    assert "TRACKER_AUTH holds a newline" in broken.stderr and "Traceback" not in broken.stderr


def test_help_names_every_command() -> None:
    result = agentd("--help")
    assert result.returncode == 0
    for command in ("serve", "migrate", "token", "status", "doctor", "install-service"):
        assert command in result.stdout
    assert "AGENTD_" in result.stdout
