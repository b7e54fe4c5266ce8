"""The daemon's lifecycle: listen address → database → migrate → reconcile → hub → dispatcher →
HTTP, and back. The address is bound first, so a busy one fails before anything was touched.

SIGTERM, SIGINT and SIGHUP (unless started under nohup) run the two-phase drain: stop claiming at
once, let in-flight turns finish within drain_s, cancel the rest (finalized failed, never
re-queued), close, exit 0. A second Ctrl-C during the drain, or SIGUSR1 at any time, cancels the
rest at once (supervisor.on_stop_signals).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass, field

import asyncpg
from aiohttp import web

from agentd import __version__, statistics
from agentd import db as dbmod
from agentd.dispatcher import Dispatcher
from agentd.executor import Journaled, TurnRunner
from agentd.group_commit import Batcher
from agentd.heartbeat import LeaseKeeper
from agentd.hub import Hub
from agentd.limits import (
    AUTH_FAILURES_PER_MIN,
    VALID_TOKEN_MEMORY_S,
    AddressRateLimiter,
    ConnectionGuard,
    GuardedSite,
    RecentlyValid,
    StreamSlots,
)
from agentd.listen import bind_listen_sockets, claim
from agentd.load import LoadMonitor
from agentd.metrics import Metrics
from agentd.notifier import Notifier
from agentd.providers import ProviderRegistry
from agentd.queue import (
    Appends,
    Finishes,
    WorkerReport,
    append_events_many,
    finish_runs,
    notify_batch,
)
from agentd.reaper import reap_forever, sweep
from agentd.revocation import RevocationWatch
from agentd.settings import Settings
from agentd.shared_reads import SharedReads
from agentd.startup import (
    Database,
    ensure_local_client,
    migrate_database,
    open_database,
    raise_open_files_limit,
    unless_stopped,
)
from agentd.supervisor import (
    DATABASE_STOP_S,
    STOP_MARGIN_S,
    Handoff,
    on_stop_signals,
    watch_parent,
)
from agentd.systemd import sd_notify, stopping
from agentd.tls import (
    NotTheFleetsCertificate,
    ServerCertificate,
    local_url,
    say_expiry,
    server_certificate,
    server_context,
)
from agentd.tools import ToolRegistry, default_tools
from agentd.tools.mcp import McpTools
from agentd.vocabulary import Channel

log = logging.getLogger("agentd.runtime")
GC_YOUNG_THRESHOLD = 50_000  # allocations between collections of the youngest generation

# Test-only: with this variable set to N seconds, SIGUSR2 blocks the event loop for N seconds
# (a worker that stops making progress while its process lives on, unlike SIGSTOP).
BLOCK_LOOP_ENV = "AGENTD_TESTHOOK_BLOCK_LOOP_S"


def new_worker_id() -> str:
    """Unique per process start: host, pid and a random suffix (never a reused host name)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass
class Runtime:
    """Everything a running agentd holds; the HTTP handlers reach it via app[api.RUNTIME]."""

    settings: Settings
    pool: asyncpg.Pool
    hub: Hub
    worker_id: str
    providers: ProviderRegistry
    dispatcher: Dispatcher | None = None
    metrics: Metrics = field(default_factory=Metrics)
    load: LoadMonitor | None = None
    keeper: LeaseKeeper | None = None
    draining: bool = False
    clock_offset_s: float = 0.0  # database clock minus ours (for lag figures, never leases)
    started_at: float = field(default_factory=time.time)
    tools: ToolRegistry = field(default_factory=ToolRegistry)  # built-ins and MCP servers
    # Reaching us from other machines: the certificate served (None: plain HTTP) and the limits.
    certificate: ServerCertificate | None = None
    connection_guard: ConnectionGuard | None = None
    revocations: RevocationWatch | None = None
    stream_slots: StreamSlots = field(init=False)
    pair_limiter: AddressRateLimiter = field(init=False)
    auth_failures: AddressRateLimiter = field(init=False)  # bearer tokens that named no one
    valid_tokens: RecentlyValid = field(init=False)  # ...and those that named a device lately
    reads: SharedReads = field(init=False)  # tails of one run woken together read once
    # Journal and terminal writes of concurrent turns share commits (group_commit.py).
    finishes: Finishes | None = None
    appends: Appends | None = None

    def __post_init__(self) -> None:
        self.reads = SharedReads(self.pool)
        self.stream_slots = StreamSlots(self.settings.streams_per_device)
        self.pair_limiter = AddressRateLimiter(self.settings.pair_attempts_per_min)
        self.auth_failures = AddressRateLimiter(AUTH_FAILURES_PER_MIN)
        self.valid_tokens = RecentlyValid(VALID_TOKEN_MEMORY_S)


def build_app(runtime: Runtime) -> web.Application:
    from agentd.api import RUNTIME, devices, health, metrics, openapi, routes
    from agentd.api.bodies import max_body_bytes

    app = web.Application(client_max_size=max_body_bytes(runtime.settings))
    app[RUNTIME] = runtime
    routes.add_routes(app)
    devices.add_routes(app)
    if runtime.connection_guard is not None:
        app.middlewares.insert(0, runtime.connection_guard.middleware)
    health.add_routes(app)
    app.router.add_get("/metrics", metrics.metrics)
    app.router.add_get("/openapi.json", openapi.serve_spec)
    return app


async def serve(settings: Settings, handoff: Handoff | None = None) -> int:
    """Run until SIGTERM, SIGINT or SIGHUP; returns the exit code.

    `handoff`: this process is a worker of a supervisor (agentd.supervisor): it serves on the
    sockets it inherited and reports readiness to the supervisor instead of systemd.
    """
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    on_stop_signals(loop, stop, hurry, supervised=handoff is not None)
    # Bound (not listening) before the database is opened: a busy address touches nothing.
    sockets = handoff.sockets if handoff else bind_listen_sockets(settings.listen_host,
                                                                  settings.listen_port)
    parent = asyncio.create_task(watch_parent(handoff, stop)) if handoff else None
    try:
        # The certificate next: a bad one fails the start before the database is touched.
        certificate = await asyncio.to_thread(server_certificate, settings) \
            if settings.serves_tls else None
        if handoff is None:  # a supervisor says it once for its workers
            say_expiry(certificate)
        elif certificate is not None and handoff.fingerprint not in (None,
                                                                     certificate.fingerprint):
            raise NotTheFleetsCertificate(certificate.fingerprint, str(handoff.fingerprint))
        raise_open_files_limit(settings.max_connections + 256)
        database = await open_database(settings)
        try:
            if handoff is None:  # a supervisor migrated before it started its workers
                applied = await unless_stopped(
                    stop, migrate_database(settings.direct_dsn(database.dsn)),
                    "waiting to migrate the database")
                if applied:
                    log.info("migrations applied", extra={"applied": ",".join(applied)})
            pool = await dbmod.create_pool(database.dsn, max_size=settings.pool_max,
                                           pooled=settings.pooled, warm=True)
            try:
                return await _serve_with_pool(settings, database, pool, stop, hurry, sockets,
                                              certificate, handoff)
            finally:
                await pool.close()
        finally:
            await asyncio.to_thread(database.close, service=True)
    finally:
        if parent is not None:
            parent.cancel()
        for sock in sockets:
            sock.close()


async def _serve_with_pool(settings: Settings, database: Database, pool: asyncpg.Pool,
                           stop: asyncio.Event, hurry: asyncio.Event,
                           sockets: list[socket.socket],
                           certificate: ServerCertificate | None,
                           handoff: Handoff | None = None) -> int:
    reconciled = await sweep(pool, settings)
    if reconciled:
        log.warning("boot reconciler failed orphaned runs", extra={"runs": reconciled})
    # Each part is closed as soon as it exists, in the reverse order: a start that fails
    # part-way (the database gone, the port taken) leaves no task or connection behind.
    async with contextlib.AsyncExitStack() as parts:
        return await _serve_parts(parts, settings, database, pool, stop, hurry, sockets,
                                  certificate, handoff)
    raise AssertionError("unreachable")  # mypy: an exit stack could swallow the exception


async def _serve_parts(parts: contextlib.AsyncExitStack, settings: Settings,
                       database: Database, pool: asyncpg.Pool, stop: asyncio.Event,
                       hurry: asyncio.Event, sockets: list[socket.socket],
                       certificate: ServerCertificate | None, handoff: Handoff | None) -> int:
    providers = ProviderRegistry(settings)
    parts.push_async_callback(providers.close)
    mcp = McpTools(settings.mcp)  # each server starts when a run first needs it
    parts.push_async_callback(mcp.close)
    tools = default_tools(settings.tool_policies, sources=[mcp])

    async def send_probe(token: str) -> None:
        await notify_batch(pool, [(Channel.HUB_PROBE, token)])

    hub = Hub(settings.hub_dsn or database.dsn, send_probe=send_probe)
    parts.push_async_callback(hub.close)
    await hub.start()
    worker_id = new_worker_id()
    runtime = Runtime(settings, pool, hub, worker_id, providers, tools=tools)
    runtime.clock_offset_s = await dbmod.clock_offset(pool)
    runtime.certificate = certificate
    runtime.connection_guard = ConnectionGuard(
        max_connections=settings.max_connections, header_timeout_s=settings.header_timeout_s,
        per_address=settings.max_connections_per_address)
    metrics = runtime.metrics
    # An ending's wake goes to this process's own claim loop alone while it claims.
    notifier = Notifier(pool, local=hub, claim_loop=lambda: runtime.dispatcher)
    notifier.start()
    parts.push_async_callback(notifier.close)
    load = LoadMonitor(pool, metrics, max_loop_lag_s=settings.max_loop_lag_ms / 1000,
                       max_pool_wait_s=settings.max_pool_wait_ms / 1000)
    runtime.load = load
    load.start()
    parts.push_async_callback(load.close)
    keeper = LeaseKeeper(settings.direct_dsn(database.dsn), hub, settings, metrics,
                         report=lambda: _worker_report(runtime))
    runtime.keeper = keeper
    keeper.start()
    # Closed after the drain: the turns still in flight until then need their beats.
    parts.push_async_callback(keeper.close, retire=True)
    # Half a keepalive: a revocation whose hint was lost still ends streams within one.
    runtime.revocations = RevocationWatch(pool, hub, poll_s=settings.keepalive_s / 2)
    runtime.revocations.start()
    parts.push_async_callback(runtime.revocations.close)
    finishes: Finishes = Batcher(pool, lambda items: finish_runs(pool, items))
    appends: Appends = Batcher(
        pool, lambda batches: append_events_many(pool, batches))
    runtime.finishes, runtime.appends = finishes, appends
    runner = TurnRunner(pool, hub, keeper, settings, providers, tools, hint=notifier.notify,
                        metrics=metrics, finishes=finishes, appends=appends,
                        journaled=Journaled(runtime.reads.journaled,
                                            notifier.notify_rows_at_hand,
                                            runtime.reads.ended))
    dispatcher = Dispatcher(pool, hub, settings, worker_id, runner.run, load, metrics,
                            hint=notifier.notify)
    runtime.dispatcher = dispatcher
    _watch_process(runtime)
    _install_test_hooks()
    app_runner = web.AppRunner(build_app(runtime), access_log=None, shutdown_timeout=1.0,
                               handler_cancellation=True,
                               keepalive_timeout=settings.idle_timeout_s,
                               # Unread request bytes after an answer (a 413, a body timeout)
                               # are drained this long at most, not aiohttp's 10 s.
                               lingering_time=2.0)
    await app_runner.setup()
    parts.push_async_callback(app_runner.cleanup)
    for name, housekeeping in (("agentd-reaper", reap_forever(pool, settings, metrics)),
                               ("agentd-statistics", statistics.keep_fresh_forever(pool))):
        parts.push_async_callback(_cancelled, asyncio.create_task(housekeeping, name=name))
    if handoff is None:  # else the supervisor did, once for all its workers
        # Before the first request is answered: once /readyz says ready, the local TUI's
        # token is there to use.
        await ensure_local_client(pool, local_url(settings),
                                  certificate.fingerprint if certificate else None,
                                  create=database.embedded is not None)
    if handoff is None:  # a supervisor claims the port before it starts its workers
        claim(sockets, settings.listen_host, settings.listen_port)
    ssl_context = server_context(certificate) if certificate else None
    from agentd.api.errors import json_error_handlers  # as build_app imports the API

    sites = [GuardedSite(app_runner, sock, guard=runtime.connection_guard,
                         ssl_context=ssl_context, handlers=json_error_handlers)
             for sock in sockets]
    for site in sites:
        await site.start()
    dispatcher.start()
    _settle_garbage_collection()
    if not settings.serves_tls and not settings.listen_is_loopback:
        log.warning("serving PLAIN HTTP on a non-loopback address (insecure_http): tokens "
                    "and pairing codes cross the network in clear text",
                    extra={"listen": settings.listen})
    log.info("agentd worker serving" if handoff else "agentd serving", extra={
        "url": sites[0].name, "worker_id": worker_id, "embedded": database.embedded is not None,
        "fingerprint": certificate.fingerprint if certificate else None})
    if handoff is not None:
        handoff.report_ready()
    else:
        sd_notify("READY=1")
    await stop.wait()
    if handoff is None:
        stopping(settings.drain_s + STOP_MARGIN_S + DATABASE_STOP_S)
    runtime.draining = True
    started = time.monotonic()
    log.info("draining the turns in flight", extra={
        "turns": len(dispatcher.in_flight), "seconds": settings.drain_s,
        "to_cancel_them_now": "Ctrl-C again, or SIGUSR1" if handoff is None
        else "Ctrl-C again, or SIGUSR1 to the supervisor"})
    await dispatcher.stop_claiming()
    finished, cancelled = await dispatcher.drain(settings.drain_s, hurry)
    log.info("drained", extra={"finished": finished, "cancelled": cancelled,
                               "seconds": round(time.monotonic() - started, 3)})
    return 0


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _worker_report(runtime: Runtime) -> WorkerReport:
    """What this process says about itself with every beat (its row in `agentd status`)."""
    host, pid, _ = runtime.worker_id.rsplit(":", 2)
    dispatcher, load = runtime.dispatcher, runtime.load
    lag_s, wait_s = load.take_peaks() if load is not None else (0.0, 0.0)
    return WorkerReport(
        worker_id=runtime.worker_id, host=host, pid=int(pid), listen=runtime.settings.listen,
        version=__version__,
        runs_in_flight=len(dispatcher.in_flight) if dispatcher is not None else 0,
        max_runs=runtime.settings.max_runs, loop_lag_ms=round(lag_s * 1000, 3),
        pool_wait_ms=round(wait_s * 1000, 3),
        admitting=not (load is not None and load.holding_back) and not runtime.draining)


def _settle_garbage_collection() -> None:
    """Keep the collector's full passes off the streams' critical path.

    Everything made until now (modules, settings, the app) lives as long as the process:
    frozen, no collection walks it again. And the youngest generation is collected after far
    more allocations than the default 700: a daemon streaming to a thousand clients allocates
    that many objects in well under a millisecond, and each collection that old objects were
    promoted by also brings the full pass nearer (measured: delta lag p99 831 ms → see
    docs/benchmarks.md). Reference cycles are still collected, just in fewer, larger passes.
    """
    gc.collect()
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, second, third)


def _watch_process(runtime: Runtime) -> None:
    """Figures other objects keep, shown by /metrics when it is scraped."""
    metrics = runtime.metrics
    metrics.read_at_scrape(metrics.in_flight, lambda: len(runtime.dispatcher.in_flight)
                           if runtime.dispatcher is not None else 0)
    metrics.read_at_scrape(metrics.pool_size, runtime.pool.get_size)
    metrics.read_at_scrape(metrics.hub_connected, lambda: int(runtime.hub.connected))
    metrics.read_at_scrape(metrics.hub_subscribers, runtime.hub.subscriber_count)
    metrics.total_at_scrape("agentd_hub_reconnects", "LISTEN reconnections.",
                            lambda: runtime.hub.reconnects)
    metrics.total_at_scrape("agentd_hub_notifications", "NOTIFY hints received.",
                            lambda: runtime.hub.notifications)
    metrics.read_at_scrape(metrics.streams_open, lambda: runtime.stream_slots.total)
    metrics.total_at_scrape("agentd_journal_commits",
                            "Shared commits of journal batches and terminal writes.",
                            lambda: (runtime.finishes.batches if runtime.finishes else 0) +
                            (runtime.appends.batches if runtime.appends else 0))
    metrics.total_at_scrape("agentd_journal_writes",
                            "Journal batches and terminal writes they carried.",
                            lambda: (runtime.finishes.items if runtime.finishes else 0) +
                            (runtime.appends.items if runtime.appends else 0))
    metrics.total_at_scrape("agentd_tail_reads_asked", "Journal reads stream tails asked for.",
                            lambda: runtime.reads.asked)
    metrics.total_at_scrape("agentd_tail_reads_issued",
                            "Journal queries sent for them (the rest joined one in flight).",
                            lambda: runtime.reads.issued)
    guard = runtime.connection_guard
    if guard is not None:
        metrics.read_at_scrape(metrics.connections_open, lambda: guard.open)
        metrics.total_at_scrape("agentd_connections_refused",
                                "Connections refused at max_connections or at "
                                "max_connections_per_address.", lambda: guard.refused)
        metrics.total_at_scrape("agentd_connections_refused_per_address",
                                "Connections refused at max_connections_per_address.",
                                lambda: guard.refused_per_address)
        metrics.total_at_scrape("agentd_header_timeouts",
                                "Connections closed for a slow request head.",
                                lambda: guard.head_timeouts)


def _install_test_hooks() -> None:
    """SIGUSR2 blocks the event loop when the test-only variable asks for it (never otherwise)."""
    seconds = float(os.environ.get(BLOCK_LOOP_ENV) or 0)
    if seconds <= 0:
        return

    def block() -> None:
        log.warning("test hook: blocking the event loop", extra={"seconds": seconds})
        time.sleep(seconds)  # on purpose: the whole loop stops, as a runaway computation would
        log.warning("test hook: the event loop runs again")

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, block)
