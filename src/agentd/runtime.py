"""The daemon's lifecycle: database → migrate → reconcile → hub → dispatcher → HTTP, and back.

SIGTERM/SIGINT run the two-phase drain: stop claiming at once, let in-flight turns finish within
drain_s, cancel the rest (finalized failed, never re-queued), close, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass, field

import asyncpg
from aiohttp import web

from agentd import db as dbmod
from agentd.accounts import create_device_token
from agentd.dispatcher import Dispatcher
from agentd.embedded_pg import EmbeddedPostgres, default_data_root
from agentd.executor import TurnRunner
from agentd.hub import Hub
from agentd.migrate import migrate
from agentd.notifier import Notifier
from agentd.providers import ProviderRegistry
from agentd.reaper import reap_forever, sweep
from agentd.settings import Settings
from agentd.systemd import sd_notify
from agentd.tools import ToolRegistry, default_tools
from agentd.tools.mcp import McpTools

log = logging.getLogger("agentd.runtime")

LOCAL_ACCOUNT = "local"


def new_worker_id() -> str:
    """Unique per process start: host, pid and a random suffix (never a reused host name)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass
class Database:
    dsn: str
    embedded: EmbeddedPostgres | None = None

    def close(self) -> None:
        if self.embedded is not None:
            self.embedded.stop()


async def open_database(settings: Settings) -> Database:
    """The configured server, or the private embedded one (started, with its database)."""
    if settings.dsn:
        return Database(settings.dsn)
    server = EmbeddedPostgres(settings.data_dir or default_data_root(), run_as=settings.pg_user)
    started = time.monotonic()
    await asyncio.to_thread(server.start)
    log.info("embedded postgresql ready", extra={
        "data_dir": str(server.data_dir), "seconds": round(time.monotonic() - started, 3)})
    admin = await asyncpg.connect(server.dsn("postgres"))
    try:
        await dbmod.ensure_agentd_database(admin)
    finally:
        await admin.close()
    return Database(server.dsn(dbmod.EMBEDDED_DATABASE), server)


async def migrate_database(dsn: str) -> list[str]:
    conn = await dbmod.connect(dsn, application_name="agentd-migrate")
    try:
        return await migrate(conn)
    finally:
        await conn.close()


async def ensure_local_client(pool: asyncpg.Pool, url: str) -> None:
    """First embedded start: give the TUI on this machine a token so it just works."""
    from agenttui.locations import config_file, write_client_config

    if config_file().exists():
        return
    token, _ = await create_device_token(pool, account=LOCAL_ACCOUNT,
                                         device=socket.gethostname() or "local")
    path = write_client_config(url, token, device=socket.gethostname())
    log.info("wrote a device token for the local client", extra={"path": str(path)})


@dataclass
class Runtime:
    """Everything a running agentd holds; the HTTP handlers reach it via app[api.RUNTIME]."""

    settings: Settings
    pool: asyncpg.Pool
    hub: Hub
    worker_id: str
    providers: ProviderRegistry
    dispatcher: Dispatcher | None = None
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    tools: ToolRegistry = field(default_factory=ToolRegistry)  # built-ins and MCP servers


def build_app(runtime: Runtime) -> web.Application:
    from agentd.api import RUNTIME, health, metrics, openapi, routes

    app = web.Application(client_max_size=1 << 20)
    app[RUNTIME] = runtime
    routes.add_routes(app)
    health.add_routes(app)
    app.router.add_get("/metrics", metrics.metrics)
    app.router.add_get("/openapi.json", openapi.serve_spec)
    return app


async def serve(settings: Settings) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    database = await open_database(settings)
    try:
        applied = await migrate_database(database.dsn)
        if applied:
            log.info("migrations applied", extra={"applied": ",".join(applied)})
        pool = await dbmod.create_pool(database.dsn, max_size=settings.pool_max)
        try:
            return await _serve_with_pool(settings, database, pool, stop)
        finally:
            await pool.close()
    finally:
        await asyncio.to_thread(database.close)


async def _serve_with_pool(settings: Settings, database: Database, pool: asyncpg.Pool,
                           stop: asyncio.Event) -> int:
    reconciled = await sweep(pool, settings)
    if reconciled:
        log.warning("boot reconciler failed orphaned runs", extra={"runs": reconciled})
    hub = Hub(settings.hub_dsn or database.dsn)
    await hub.start()
    providers = ProviderRegistry(settings)
    worker_id = new_worker_id()
    mcp = McpTools(settings.mcp)  # each server starts when a run first needs it
    tools = default_tools(settings.tool_policies, sources=[mcp])
    runtime = Runtime(settings, pool, hub, worker_id, providers, tools=tools)
    notifier = Notifier(pool)
    notifier.start()
    runner = TurnRunner(pool, hub, settings, providers, tools, hint=notifier.notify)
    dispatcher = Dispatcher(pool, hub, settings, worker_id, runner.run, hint=notifier.notify)
    runtime.dispatcher = dispatcher
    app_runner = web.AppRunner(build_app(runtime), access_log=None, shutdown_timeout=1.0,
                               handler_cancellation=True)
    await app_runner.setup()
    reaping = asyncio.create_task(reap_forever(pool, settings), name="agentd-reaper")
    try:
        site = web.TCPSite(app_runner, settings.listen_host, settings.listen_port)
        await site.start()
        url = f"http://{settings.listen}"
        if database.embedded is not None:
            await ensure_local_client(pool, url)
        dispatcher.start()
        log.info("agentd serving", extra={"listen": settings.listen, "worker_id": worker_id,
                                          "embedded": database.embedded is not None})
        sd_notify("READY=1")
        await stop.wait()
        sd_notify("STOPPING=1")
        runtime.draining = True
        started = time.monotonic()
        await dispatcher.stop_claiming()
        finished, cancelled = await dispatcher.drain(settings.drain_s)
        log.info("drained", extra={"finished": finished, "cancelled": cancelled,
                                   "seconds": round(time.monotonic() - started, 3)})
        return 0
    finally:
        reaping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaping
        await app_runner.cleanup()
        await notifier.close()
        await hub.close()
        await providers.close()
        await mcp.close()
