"""`agentd`: serve, migrate, token create|list|revoke, status, doctor, install-service.

A stable contract: scripts and tests drive these commands and parse their output.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agentd import __version__
from agentd.settings import Settings, SettingsError, load_settings

EPILOG = """Every setting also has a config-file key and an AGENTD_* environment variable
(e.g. AGENTD_DSN, AGENTD_LISTEN, AGENTD_LEASE_TTL_S). Without a DSN agentd runs its own
embedded PostgreSQL and the offline demo model, so `agentd serve` works on a fresh machine."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentd", description="Durable AI-agent turns on PostgreSQL.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"agentd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def db_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--config", type=Path, help="TOML config file (default: the user "
                         "config dir's agentd/config.toml)")
        where = sub.add_mutually_exclusive_group()
        where.add_argument("--dsn", help="PostgreSQL DSN; omit to use the embedded server")
        where.add_argument("--data-dir", type=Path,
                           help="where the embedded PostgreSQL keeps its data")

    serve = commands.add_parser("serve", help="run the daemon in the foreground",
                                description="Run agentd until SIGTERM/SIGINT (then drain).")
    db_options(serve)
    serve.add_argument("--listen", metavar="HOST:PORT", help="HTTP address "
                       "(default 127.0.0.1:8740)")

    mig = commands.add_parser("migrate", help="apply pending database migrations")
    db_options(mig)

    token = commands.add_parser("token", help="manage device tokens")
    token_cmds = token.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    create = token_cmds.add_parser("create", help="mint a token; prints it alone on stdout")
    db_options(create)
    create.add_argument("--account", required=True, help="account name (created if missing)")
    create.add_argument("--device", required=True, help="device name shown to other devices")
    listing = token_cmds.add_parser("list", help="list devices (never their tokens)")
    db_options(listing)
    revoke = token_cmds.add_parser("revoke", help="revoke a device's token")
    db_options(revoke)
    revoke.add_argument("device_id", help="the device id shown by `agentd token list`")

    status = commands.add_parser("status", help="queue depth, running turns, live workers")
    db_options(status)
    doctor = commands.add_parser("doctor", help="check this installation and say what to fix")
    db_options(doctor)

    install = commands.add_parser("install-service",
                                  help="write and enable a systemd user unit")
    install.add_argument("--no-enable", action="store_true",
                         help="only write the unit file")
    install.add_argument("serve_args", nargs=argparse.REMAINDER,
                         help="extra arguments for `agentd serve` in the unit")
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {"dsn": getattr(args, "dsn", None),
                                 "data_dir": getattr(args, "data_dir", None),
                                 "listen": getattr(args, "listen", None)}
    return load_settings(getattr(args, "config", None), overrides=overrides)


def _fail(message: str, code: int = 2) -> None:
    print(f"agentd: {message}", file=sys.stderr)
    raise SystemExit(code)


async def _with_pool(settings: Settings, work: Callable[[Any], Awaitable[int]]) -> int:
    from agentd import db as dbmod
    from agentd.runtime import migrate_database, open_database

    database = await open_database(settings)
    try:
        await migrate_database(database.dsn)
        pool = await dbmod.create_pool(database.dsn, min_size=1, max_size=2)
        try:
            return await work(pool)
        finally:
            await pool.close()
    finally:
        await asyncio.to_thread(database.close)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "install-service":
        raise SystemExit(_install_service(args))
    try:
        settings = _settings(args)
    except SettingsError as exc:
        _fail(f"invalid setting: {exc}")
    from agentd.embedded_pg import EmbeddedPgError
    from agentd.listen import ListenError
    from agentd.logs import configure_logging

    configure_logging(settings.log_level if args.command == "serve" else "warning")
    handlers: dict[str, Callable[[Settings, argparse.Namespace], Awaitable[int]]] = {
        "serve": _serve, "migrate": _migrate, "token": _token, "status": _status,
        "doctor": _doctor}
    try:
        code = asyncio.run(handlers[args.command](settings, args))
    except EmbeddedPgError as exc:
        _fail(f"{exc}\nPass --dsn (or AGENTD_DSN) to use an existing PostgreSQL server.")
    except ListenError as exc:
        _fail(str(exc), 1)
    except (OSError, ConnectionError) as exc:
        _fail(f"cannot reach the database: {exc}", 1)
    except KeyboardInterrupt:
        code = 130
    raise SystemExit(code)


async def _serve(settings: Settings, _args: argparse.Namespace) -> int:
    from agentd.runtime import serve

    return await serve(settings)


async def _migrate(settings: Settings, _args: argparse.Namespace) -> int:
    from agentd.runtime import migrate_database, open_database

    database = await open_database(settings)
    try:
        applied = await migrate_database(database.dsn)
    finally:
        await asyncio.to_thread(database.close)
    print("applied: " + ", ".join(applied) if applied else "schema is up to date")
    return 0


async def _token(settings: Settings, args: argparse.Namespace) -> int:
    from agentd import accounts

    async def work(pool: Any) -> int:
        if args.token_command == "create":
            token, _ = await accounts.create_device_token(pool, account=args.account,
                                                          device=args.device)
            print(token)
        elif args.token_command == "list":
            print(f"{'device_id':36}  {'account':12}  {'device':16}  {'last_seen':20}  state")
            for d in await accounts.list_devices(pool):
                seen = d.last_seen_at.strftime("%Y-%m-%d %H:%M:%S") if d.last_seen_at else "-"
                state = "revoked" if d.revoked_at else "active"
                print(f"{d.id!s:36}  {d.account:12}  {d.name:16}  {seen:20}  {state}")
        else:
            try:
                device_id = uuid.UUID(args.device_id)
            except ValueError:
                _fail(f"not a device id: {args.device_id!r}")
            if not await accounts.revoke_device(pool, device_id):
                _fail(f"no active device {device_id}", 1)
            print(f"revoked {device_id}")
        return 0

    return await _with_pool(settings, work)


async def _status(settings: Settings, _args: argparse.Namespace) -> int:
    from agentd.queries import Q

    async def work(pool: Any) -> int:
        row = await pool.fetchrow(Q["queue_status"])
        print(f"queued: {row['queued']}\nrunning: {row['running']}\n"
              f"expired leases awaiting the reaper: {row['expired']}\n"
              f"live workers: {', '.join(row['workers']) or '-'}")
        return 0

    return await _with_pool(settings, work)


async def _doctor(settings: Settings, _args: argparse.Namespace) -> int:
    from agentd.doctor import run_checks

    problems = 0
    for check in await run_checks(settings):
        mark = "ok  " if check.ok else "FAIL"
        print(f"[{mark}] {check.name}: {check.detail}")
        problems += not check.ok
    return 1 if problems else 0


def _install_service(args: argparse.Namespace) -> int:
    from agentd.systemd import unit_text, user_unit_path

    extra = [a for a in args.serve_args if a != "--"]
    path = user_unit_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(unit_text(["serve", *extra]), "utf-8")
    print(f"wrote {path}")
    if args.no_enable:
        return 0
    if shutil.which("systemctl") is None:
        print("systemctl not found: enable it with `systemctl --user enable --now agentd`")
        return 0
    for command in (["systemctl", "--user", "daemon-reload"],
                    ["systemctl", "--user", "enable", "--now", "agentd.service"]):
        result = subprocess.run(command, check=False)
        if result.returncode != 0:
            print(f"`{' '.join(command)}` failed (exit {result.returncode})", file=sys.stderr)
            return 1
    print("agentd.service enabled and started (journalctl --user -u agentd -f)")
    return 0
