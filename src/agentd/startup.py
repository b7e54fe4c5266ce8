"""What every start does before serving, shared by a single agentd and a supervisor: open the
database (the embedded server or the DSN), migrate, keep the local client attached, and the
open-files limit. Light on imports: a supervisor runs only this, not the daemon's machinery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import asyncpg

from agentd import db as dbmod
from agentd.accounts import create_device_token, revoke_device
from agentd.embedded_pg import EmbeddedPostgres, default_data_root
from agentd.migrate import discover, migrate, pending
from agentd.settings import Settings, is_loopback_host
from agentd.systemd import supervised

log = logging.getLogger("agentd.startup")
_T = TypeVar("_T")

LOCAL_ACCOUNT = "local"


@dataclass
class Database:
    dsn: str
    embedded: EmbeddedPostgres | None = None

    def close(self, *, service: bool = False) -> None:
        """Stop using the embedded server (the last process using it stops it). `service`:
        the daemon itself (serve, or a supervisor) closes it."""
        if self.embedded is not None:
            # A stopping systemd unit kills whatever it started that is left once its main
            # process exits, the server it started too: a clean stop here beats that kill.
            self.embedded.stop(force=service and self.embedded.owns_server and supervised())


async def open_database(settings: Settings) -> Database:
    """The configured server, or the private embedded one (started, with its database)."""
    if settings.dsn:
        return Database(settings.dsn)
    server = EmbeddedPostgres(settings.data_dir or default_data_root(), run_as=settings.pg_user)
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    # The executor's own future, not a task: asyncio.run's shutdown cancels every task, and a
    # cancelled wait would not know when the start in its thread ended.
    starting = loop.run_in_executor(None, server.start)
    try:
        # Shielded: a stop (SIGTERM, Ctrl-C) or an error from here on still lets the start
        # finish, and then stops using the server, which the last user out stops: a command
        # ended mid-start used to leave the server it started running for nobody.
        await asyncio.shield(starting)
        log.info("embedded postgresql ready", extra={
            "data_dir": str(server.data_dir), "seconds": round(time.monotonic() - started, 3)})
        admin = await asyncpg.connect(server.dsn("postgres"))
        try:
            await dbmod.ensure_agentd_database(admin)
        finally:
            await admin.close()
    except BaseException:
        if not starting.done():  # a failed start is the error raised here: said once, not twice
            await _to_the_end(starting)
        await _to_the_end(loop.run_in_executor(None, server.stop))
        raise
    return Database(server.dsn(dbmod.EMBEDDED_DATABASE), server)


async def _to_the_end(work: asyncio.Future[None]) -> None:
    """Wait for `work` (in a thread) to end, whatever a second Ctrl-C or SIGTERM raises here
    meanwhile: a start or stop of the embedded server cut short leaves it to nobody."""
    while not work.done():
        with contextlib.suppress(BaseException):
            await asyncio.shield(work)
    if not work.cancelled() and work.exception() is not None:
        log.warning("the embedded postgresql's start or stop failed while the command ended",
                    extra={"error": str(work.exception())})


class StoppedWhileStarting(Exception):
    """A stop signal came before the daemon served (while it waited for the migration)."""


async def unless_stopped(stop: asyncio.Event, step: Awaitable[_T], what: str) -> _T:
    """`step`, or StoppedWhileStarting as soon as `stop` is set (the step is cancelled): a
    start that waits, for another process's migration or an unreachable database, must still
    end on SIGTERM or Ctrl-C rather than only on SIGKILL."""
    running = asyncio.ensure_future(step)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([running, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if running.done():
        return running.result()
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await running
    raise StoppedWhileStarting(f"stopped while {what}")


class SchemaBehind(Exception):
    """The database's schema lacks migrations this agentd has, and the command only reads."""


async def require_current_schema(dsn: str) -> None:
    """Raise SchemaBehind unless every migration this agentd knows is applied (read only)."""
    conn = await dbmod.connect(dsn, application_name="agentd-cli")
    try:
        missing = await pending(conn)
    finally:
        await conn.close()
    if not missing:
        return
    what = ("holds no agentd schema yet" if len(missing) == len(discover())
            else f"lacks {len(missing)} migration{'s' if len(missing) > 1 else ''} of this "
                 f"agentd (from {missing[0]})")
    raise SchemaBehind(f"the database {what}; this command only reads: run `agentd migrate` "
                       "(or start `agentd serve`) first")


async def migrate_database(dsn: str) -> list[str]:
    conn = await dbmod.connect(dsn, application_name="agentd-migrate")
    try:
        return await migrate(conn)
    finally:
        await conn.close()


async def ensure_local_client(pool: asyncpg.Pool, url: str, fingerprint: str | None = None,
                              *, create: bool = True) -> None:
    """Keep the TUI on this machine attached: give it a token on the first embedded start.

    Over TLS it also pins this daemon's certificate, as `agenttui login` would; a config that
    already points at this port on loopback follows a switch to or from TLS, or a new
    certificate (this daemon is the authority on its own certificate, on its own machine).

    A config file it cannot read or write is the local TUI's loss, never the daemon's: it is
    logged and agentd serves on (the TUI then needs `agenttui login`). A token whose file could
    not be written is revoked at once, so none is left behind for nobody.
    """
    from agentd.client_config import config_file

    try:
        await _ensure_local_client(pool, url, fingerprint, create=create)
    # ValueError: text that is not TOML or UTF-8, a URL in it that does not parse.
    except (OSError, ValueError) as exc:
        log.warning("could not keep the local client's config: agenttui on this machine needs "
                    "`agenttui login`", extra={"path": str(config_file()), "reason": str(exc)})


async def _ensure_local_client(pool: asyncpg.Pool, url: str, fingerprint: str | None, *,
                               create: bool) -> None:
    from agentd.client_config import config_file, read_config, write_client_config

    if config_file().exists():
        config = read_config()
        old, token = config.get("url"), config.get("token")
        if not isinstance(old, str) or not isinstance(token, str):
            return
        before, now = urlsplit(old), urlsplit(url)
        if before.port != now.port or not is_loopback_host(before.hostname or ""):
            return
        if (old, config.get("fingerprint")) != (url, fingerprint):
            device = config.get("device")
            path = write_client_config(url, token, device=device if isinstance(device, str)
                                       else None, fingerprint=fingerprint)
            log.info("updated the local client's address and pin", extra={
                "path": str(path), "url": url, "fingerprint": fingerprint})
        return
    if not create:
        return
    token, device_id = await create_device_token(pool, account=LOCAL_ACCOUNT,
                                                 device=socket.gethostname() or "local")
    try:
        # Written once the token exists, so the file never holds a token that does not.
        path = write_client_config(url, token, device=socket.gethostname(),
                                   fingerprint=fingerprint)
    except BaseException:
        await asyncio.shield(revoke_device(pool, device_id))  # no token left for nobody
        raise
    log.info("wrote a device token for the local client", extra={"path": str(path)})


def raise_open_files_limit(wanted: int) -> None:
    """Every connection is a file descriptor: let max_connections fit under RLIMIT_NOFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if hard != resource.RLIM_INFINITY and hard < wanted:
        log.warning("the open-files limit is below max_connections; lower max_connections "
                    "or raise LimitNOFILE", extra={"hard_limit": hard, "wanted": wanted})
