"""`agentd`: serve, pair, migrate, token create|list|revoke, account set|show, status, doctor,
install-service.

A stable contract: scripts and tests drive these commands and parse their output.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, NoReturn

from agentd import __version__
from agentd.files import make_private_dirs, replace_file
from agentd.settings import Settings, SettingsError, load_settings, read_config

EPILOG = """Every setting also has a config-file key and an AGENTD_* environment variable
(e.g. AGENTD_DSN, AGENTD_LISTEN, AGENTD_LEASE_TTL_S). Without a DSN agentd runs its own
embedded PostgreSQL and the offline demo model, so `agentd serve` works on a fresh machine."""

log = logging.getLogger("agentd.cli")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the full usage is one --help away), and no
    option abbreviated: install-service finds a flag's value (a DSN's password, a data
    directory) by its whole name, so `--ds` must not quietly mean `--dsn`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="agentd", description="Durable AI-agent turns on PostgreSQL.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"agentd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=_Parser)

    def db_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--config", type=Path, help="TOML config file (default: the user "
                         "config dir's agentd/config.toml)")
        where = sub.add_mutually_exclusive_group()
        where.add_argument("--dsn", help="PostgreSQL DSN; omit to use the embedded server")
        where.add_argument("--data-dir", type=Path,
                           help="where the embedded PostgreSQL keeps its data")

    serve = commands.add_parser("serve", help="run the daemon in the foreground",
                                description="Run agentd until SIGTERM, SIGINT or SIGHUP, "
                                            "then drain: turns in flight get drain_s to "
                                            "finish; Ctrl-C again, or SIGUSR1, cancels them "
                                            "at once.")
    db_options(serve)
    serve.add_argument("--listen", metavar="HOST:PORT", help="HTTP address "
                       "(default 127.0.0.1:8740; any other than loopback serves HTTPS)")
    serve.add_argument("--workers", type=int, metavar="N",
                       help="worker processes behind the one address (default: one per core; "
                            "max_runs and pool_max apply to each)")
    serve.add_argument("--insecure-http", action="store_true", default=None,
                       help="serve plain HTTP on a non-loopback address (tokens cross the "
                            "network in clear text; warned at every start)")

    pair = commands.add_parser(
        "pair", help="a one-time code for another device to attach with agenttui",
        description="Mint a one-time pairing code (valid pairing_ttl_s, 10 minutes by "
                    "default; single use) and print the `agenttui login` line to run on the "
                    "other machine, with this server's certificate fingerprint to pin. Use "
                    "the same settings (config, --listen, --data-dir) as `agentd serve`.")
    db_options(pair)
    pair.add_argument("--account", required=True, help="account the new device joins "
                      "(created if missing)")
    pair.add_argument("--device", required=True, help="name of the new device")
    pair.add_argument("--listen", metavar="HOST:PORT", help="the address `agentd serve` "
                      "listens on, if not in the config")

    mig = commands.add_parser("migrate", help="apply pending database migrations")
    db_options(mig)

    token = commands.add_parser("token", help="manage device tokens")
    token_cmds = token.add_subparsers(dest="token_command", required=True, metavar="ACTION",
                                      parser_class=_Parser)
    create = token_cmds.add_parser("create", help="mint a token; prints it alone on stdout")
    db_options(create)
    create.add_argument("--account", required=True, help="account name (created if missing)")
    create.add_argument("--device", required=True, help="device name shown to other devices")
    listing = token_cmds.add_parser("list", help="list devices (never their tokens)")
    db_options(listing)
    revoke = token_cmds.add_parser("revoke", help="revoke a device's token")
    db_options(revoke)
    revoke.add_argument("device_id", help="the device id shown by `agentd token list`")

    account = commands.add_parser("account", help="per-account limits: running, queued, "
                                  "models")
    account_cmds = account.add_subparsers(dest="account_command", required=True,
                                          metavar="ACTION", parser_class=_Parser)
    limits = account_cmds.add_parser(
        "set", help="set an account's limits (created if missing)",
        description="Set limits for one account, in the database: every daemon of the fleet "
                    "enforces them from its next claim or enqueue (running turns are never "
                    "cut short). Only the options given change; 'default' restores the "
                    "fleet's default (account_max_running, account_max_queued, every model).")
    db_options(limits)
    limits.add_argument("name", help="the account")
    limits.add_argument("--max-running", metavar="N", help="turns of the account running at "
                        "once across the fleet (0-10000, or 'default')")
    limits.add_argument("--max-queued", metavar="M", help="turns it may have queued; over "
                        "this an enqueue answers 429 (0-1000000, or 'default')")
    limits.add_argument("--models", metavar="PATTERNS", help="comma-separated model patterns "
                        "it may use, e.g. 'openai:*,local:*,demo' (or 'all')")
    show = account_cmds.add_parser("show", help="accounts, their limits and their turns now")
    db_options(show)
    show.add_argument("name", nargs="?", help="one account (default: all)")

    status = commands.add_parser(
        "status", help="the fleet at a glance: workers, queue by account, running turns",
        description="Live workers (from their heartbeats: host, pid, runs in flight, last beat, "
                    "event-loop lag, pool wait), queue depth by account with their limits, and "
                    "who owns which running conversation (the device that asked, the worker, "
                    "the lease left). Read from the database: any machine of the fleet shows "
                    "the same.")
    db_options(status)
    status.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    doctor = commands.add_parser("doctor", help="check this installation and say what to fix")
    db_options(doctor)

    install = commands.add_parser("install-service",
                                  help="write and enable a systemd user unit")
    install.add_argument("--no-enable", action="store_true",
                         help="only write the unit file")
    install.add_argument("serve_args", nargs=argparse.REMAINDER,
                         help="arguments for `agentd serve` in the unit, after `--` (e.g. "
                              "`agentd install-service -- --listen 0.0.0.0:8740`); checked "
                              "as serve checks them, paths made absolute, a --dsn moved to "
                              "the 0600 environment file")
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {"dsn": getattr(args, "dsn", None),
                                 "data_dir": getattr(args, "data_dir", None),
                                 "listen": getattr(args, "listen", None),
                                 "insecure_http": getattr(args, "insecure_http", None),
                                 "workers": getattr(args, "workers", None)}
    config_file = getattr(args, "config", None)
    source = None
    if args.command == "serve":
        from agentd.supervisor import config_from_supervisor

        source = config_from_supervisor(config_file) or read_config(config_file)
        args.config_source = source  # a supervisor hands this same text to its workers
    return load_settings(config_file, overrides=overrides, source=source)


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"agentd: {message}", file=sys.stderr)
    raise SystemExit(code)


async def _with_pool(settings: Settings, work: Callable[[Any], Awaitable[int]], *,
                     writes: bool) -> int:
    """Run `work` on a small pool. A command that writes first brings the schema up to date;
    one that only reads changes nothing, and asks for `agentd migrate` if the schema is behind
    (a monitoring script's `agentd status` must not run DDL on a fleet's database)."""
    from agentd import db as dbmod
    from agentd.startup import migrate_database, open_database, require_current_schema

    database = await open_database(settings)
    try:
        if writes:
            await migrate_database(settings.direct_dsn(database.dsn))
        else:
            await require_current_schema(settings.direct_dsn(database.dsn))
        pool = await dbmod.create_pool(database.dsn, min_size=1, max_size=2,
                                       pooled=settings.pooled)
        try:
            return await work(pool)
        finally:
            await pool.close()
    finally:
        await asyncio.to_thread(database.close)


def main(argv: list[str] | None = None) -> None:
    """Every failure a user can cause (a bad value, an unreachable or refusing database, input
    the database rejects) ends in one `agentd: …` line and a non-zero exit, never a traceback."""
    args = _parser().parse_args(argv)
    if args.command == "install-service":
        raise SystemExit(_install_service(args))
    try:
        settings = _settings(args)
    except SettingsError as exc:
        _fail(f"invalid setting: {exc}")
    if args.command == "serve":
        from agentd.providers.catalog import default_model_problem

        # A typo here would refuse every run that names no model, from the first one on.
        problem = default_model_problem(settings)
        if problem is not None:
            _fail(f"invalid setting: default_model (AGENTD_DEFAULT_MODEL): {problem}")
    import asyncpg

    from agentd.embedded_pg import EmbeddedPgError
    from agentd.listen import ListenError
    from agentd.logs import configure_logging
    from agentd.startup import SchemaBehind, StoppedWhileStarting
    from agentd.supervisor import SLOT_ENV
    from agentd.tls import NotTheFleetsCertificate, TLSError

    configure_logging(settings.log_level if args.command == "serve" else "warning",
                      worker=os.environ.get(SLOT_ENV) if args.command == "serve" else None)
    handlers: dict[str, Callable[[Settings, argparse.Namespace], Coroutine[Any, Any, int]]] = {
        "serve": _serve, "pair": _pair, "migrate": _migrate, "token": _token,
        "account": _account, "status": _status, "doctor": _doctor}
    if args.command != "serve":  # serve stops in its own two phases (runtime.on_stop_signals)
        signal.signal(signal.SIGTERM, _terminated)
    try:
        code = asyncio.run(handlers[args.command](settings, args))
    except EmbeddedPgError as exc:
        # The database cannot be had, as when a server cannot be reached: exit 1 (2 is for
        # a malformed value, checked before anything starts).
        _fail(f"{exc}. Pass --dsn (or AGENTD_DSN) to use an existing PostgreSQL server.", 1)
    except NotTheFleetsCertificate as exc:
        _fail(str(exc))
    except TLSError as exc:
        _fail(f"{exc}. Fix tls_cert/tls_key, or remove them to use a self-signed certificate.")
    except ListenError as exc:
        _fail(str(exc), 1)
    except SchemaBehind as exc:
        _fail(str(exc), 1)
    except StoppedWhileStarting as exc:  # a stop asked for before it served: done as asked
        print(f"agentd: {exc}", file=sys.stderr)
        code = 0
    except asyncpg.ClientConfigurationError as exc:
        _fail(f"invalid setting: dsn: {exc}")
    except asyncpg.PostgresError as exc:  # e.g. unknown role or database, a refused password
        _fail(f"the database refused: {_one_line(str(exc))}", 1)
    except OSError as exc:
        if exc.filename is not None:  # a file or directory (tls/, the data root), no server
            _fail(f"cannot use {exc.filename}: {exc.strerror or exc}", 1)
        _fail(f"cannot reach the database: {exc}", 1)
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:  # a bug: still one line (AGENTD_LOG_LEVEL=debug logs the trace)
        log.debug("agentd %s failed", args.command, exc_info=True)
        _fail(f"{args.command} failed: {type(exc).__name__}: {_one_line(str(exc))}", 1)
    raise SystemExit(code)


def _terminated(signum: int, _frame: object) -> None:
    """SIGTERM ends a command as Ctrl-C would: unwinding, so that it stops the embedded server
    it started (when nothing else uses it) rather than leaving it running for nobody."""
    raise SystemExit(128 + signum)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _name(what: str, value: str) -> str:
    """A name the database accepts, or exit with the rule (before any database is touched)."""
    from agentd.accounts import check_name

    try:
        return check_name(what, value)
    except ValueError as exc:
        _fail(str(exc))


async def _serve(settings: Settings, args: argparse.Namespace) -> int:
    from agentd import supervisor

    handoff = supervisor.handoff_from_environment()
    if handoff is None:
        count = supervisor.worker_count(settings)
        if count > 1:  # the supervisor never imports the daemon's machinery: it stays small
            return await supervisor.supervise(settings, count, args.config_source)
    from agentd.runtime import serve

    return await serve(settings, handoff)


async def _pair(settings: Settings, args: argparse.Namespace) -> int:
    from agentd import accounts, pairing
    from agentd.api.devices import login_command
    from agentd.tls import public_url, server_certificate

    _name("--account", args.account)
    _name("--device", args.device)
    certificate = await asyncio.to_thread(server_certificate, settings) \
        if settings.serves_tls else None

    async def work(pool: Any) -> int:
        account_id = await accounts.ensure_account(pool, args.account)
        try:
            made = await pairing.create_pairing(pool, account_id=account_id,
                                                device_name=args.device, created_by=None,
                                                ttl_s=settings.pairing_ttl_s)
        except pairing.TooManyOpenCodes as exc:
            _fail(str(exc), 1)
        url = public_url(settings)
        minutes = settings.pairing_ttl_s / 60
        print(f"Pairing code for device {args.device!r} of account {args.account!r}: "
              f"{made.code}")
        print(f"Valid once, for {minutes:g} minutes. On the other machine run:\n")
        print("  " + login_command(url, made.code,
                                   certificate.fingerprint if certificate else None) + "\n")
        if certificate is not None:
            print(f"The fingerprint pins this server's certificate ({certificate.cert_path}).")
        if settings.listen_is_loopback:
            print(f"agentd listens on {settings.listen}, which other machines cannot reach: "
                  "serve on a reachable address (e.g. --listen 0.0.0.0:8740, or `listen` in "
                  "the config) and pass the same --listen here.", file=sys.stderr)
        elif certificate is None:
            print("warning: plain HTTP (insecure_http): the token travels in clear text.",
                  file=sys.stderr)
        return 0

    return await _with_pool(settings, work, writes=True)


async def _migrate(settings: Settings, _args: argparse.Namespace) -> int:
    from agentd.startup import migrate_database, open_database

    database = await open_database(settings)
    try:
        applied = await migrate_database(settings.direct_dsn(database.dsn))
    finally:
        await asyncio.to_thread(database.close)
    print("applied: " + ", ".join(applied) if applied else "schema is up to date")
    return 0


async def _token(settings: Settings, args: argparse.Namespace) -> int:
    from agentd import accounts

    if args.token_command == "create":
        _name("--account", args.account)
        _name("--device", args.device)
    elif args.token_command == "revoke":
        try:
            device_id = uuid.UUID(args.device_id)
        except ValueError:
            _fail(f"not a device id: {args.device_id!r}")

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
            revocation = await accounts.revoke_device(pool, device_id)
            if revocation is None:
                _fail(f"no device {device_id}", 1)
            when = revocation.revoked_at.strftime("%Y-%m-%d %H:%M:%S %Z")
            print(f"{device_id} was already revoked ({when})" if revocation.again
                  else f"revoked {device_id}")
        return 0

    return await _with_pool(settings, work, writes=args.token_command != "list")


async def _account(settings: Settings, args: argparse.Namespace) -> int:
    from agentd import accounts

    change = None
    if args.account_command == "set":
        try:
            change = accounts.parse_limit_change(max_running=args.max_running,
                                                 max_queued=args.max_queued,
                                                 models=args.models,
                                                 providers=settings.providers)
        except ValueError as exc:
            _fail(str(exc))  # before any database is touched
        if not (change.change_running or change.change_queued or change.change_models):
            _fail("nothing to set: give --max-running, --max-queued or --models")
        _name("the account name", args.name)
    elif args.name is not None:
        _name("the account name", args.name)

    async def work(pool: Any) -> int:
        if change is not None:
            shown = [await accounts.set_account_limits(pool, args.name, change)]
        else:
            shown = await accounts.account_limits(pool, args.name)
            if args.name and not shown:
                _fail(f"no account named {args.name!r}", 1)
        print(f"{'account':24} {'max running':>14} {'max queued':>14} {'running':>8} "
              f"{'queued':>8}  models")
        for a in shown:
            running = _own_or_default(a.max_running, settings.account_max_running)
            queued = _own_or_default(a.max_queued, settings.account_max_queued)
            models = ",".join(a.models) if a.models is not None else "all (default)"
            print(f"{a.name[:24]:24} {running:>14} {queued:>14} {a.running:>8} "
                  f"{a.queued:>8}  {models}")
        return 0

    return await _with_pool(settings, work, writes=change is not None)


def _own_or_default(own: int | None, default: int) -> str:
    return f"{default} (default)" if own is None else str(own)


async def _status(settings: Settings, args: argparse.Namespace) -> int:
    from agentd.fleet_status import as_json, as_text, read_fleet_status

    async def work(pool: Any) -> int:
        status = await read_fleet_status(pool, settings)
        print(as_json(status) if args.json else as_text(status))
        return 0

    return await _with_pool(settings, work, writes=False)


async def _doctor(settings: Settings, _args: argparse.Namespace) -> int:
    from agentd.doctor import run_checks

    problems = 0
    for check in await run_checks(settings):
        mark = "FAIL" if not check.ok else "warn" if check.warn else "ok  "
        print(f"[{mark}] {check.name}: {check.detail}")
        problems += not check.ok
    return 1 if problems else 0


def _install_service(args: argparse.Namespace) -> int:
    """Write the unit (no secret in it) and its 0600 environment file, then enable it."""
    from agentd import systemd

    extra, moved = systemd.split_secrets([a for a in args.serve_args if a != "--"])
    variables = {k: v for k, v in os.environ.items() if k.startswith("AGENTD_")}
    variables.update(moved)
    # Paths as this shell means them (the unit runs from another directory), as the flags'.
    for key in ("AGENTD_DATA_DIR", "AGENTD_CONFIG"):
        if variables.get(key):
            variables[key] = str(Path(variables[key]).expanduser().resolve())
    # The unit's `serve` must start: refuse what it would refuse, before writing anything.
    serve_args = _parser().parse_args(["serve", *extra])
    # Paths as this shell means them: the unit runs from another directory.
    extra = systemd.absolute_paths(extra, ("--data-dir", "--config"))
    try:
        settings = load_settings(
            getattr(serve_args, "config", None), env={**os.environ, **variables},
            overrides={"dsn": serve_args.dsn, "data_dir": serve_args.data_dir,
                       "listen": serve_args.listen, "insecure_http": serve_args.insecure_http,
                       "workers": serve_args.workers})
    except SettingsError as exc:
        _fail(f"invalid setting for the service: {exc}")
    from agentd.providers.catalog import default_model_problem

    problem = default_model_problem(settings)
    if problem is not None:  # serve would refuse it at every start
        _fail(f"invalid setting for the service: default_model (AGENTD_DEFAULT_MODEL): "
              f"{problem}")
    secrets, unset = _secret_variables(settings)
    variables.update(secrets)
    try:
        path, env_path = _write_service_files(extra, variables, settings.data_dir)
    except ValueError as exc:  # a value an environment file cannot carry
        _fail(f"cannot write the service: {exc}")
    except OSError as exc:
        _fail(f"cannot write the service: {exc}", 1)
    print(f"wrote {path}")
    print(f"wrote {env_path} (mode 0600: {', '.join(sorted(variables)) or 'no variables'})")
    for variable, user in unset:
        print(f"note: {user} reads {variable}, which is not set in this shell, so the service "
              f"will not have it: set it and run install-service again", file=sys.stderr)
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


def _write_service_files(extra: list[str], variables: dict[str, str],
                         data_dir: Path | None) -> tuple[Path, Path]:
    from agentd import systemd
    from agentd.client_config import config_dir as client_config_dir

    data_root = data_dir.expanduser().resolve() if data_dir else _default_data_root()
    data_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    # The unit may write the local client's config there (ReadWritePaths), but systemd skips a
    # path that does not exist, and under ProtectSystem=strict the service cannot make it.
    make_private_dirs(client_config_dir())
    env_path = systemd.environment_file_path()
    env_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    replace_file(env_path, systemd.environment_file_text(variables))
    path = systemd.user_unit_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(systemd.unit_text(["serve", *extra], env_file=env_path,
                                      writable=[data_root],
                                      optional_writable=[client_config_dir()]), "utf-8")
    return path, env_path


def _secret_variables(settings: Settings) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The secrets the service reads from its environment, by the names the config gives
    them (providers' API keys, MCP servers' header values), as set in this shell; and those
    named but not set here, with what reads each."""
    # Switched-off providers' too: the unit reads the config file at each start, and one
    # switched on later must find its key.
    wanted = {config.api_key_env: f"provider {name}"
              for name, config in settings.providers.items() if config.api_key_env}
    for name, server in settings.mcp.items():
        for header, variable in server.headers.items():
            wanted.setdefault(variable, f"MCP server {name}'s {header} header")
    found = {name: os.environ[name] for name in sorted(wanted) if os.environ.get(name)}
    # A built-in provider's key that is not set is no fault: most use one provider or none.
    unset = [(name, user) for name, user in sorted(wanted.items())
             if name not in found and user.startswith("MCP")]
    return found, unset


def _default_data_root() -> Path:
    from agentd.embedded_pg import default_data_root

    return default_data_root()


