"""`agentd serve --workers N`: one small supervisor, N full agentd worker processes, one port.

The supervisor binds the listen address once, owns the embedded PostgreSQL, migrates, makes the
certificate and the local client's token, then starts N workers that inherit the bound socket
(each accepts from it: one port, every core). Workers coordinate through the database as any
fleet does. The supervisor reports READY to systemd once every worker serves, fans SIGTERM,
SIGINT and SIGHUP out for each worker's own two-phase drain, and restarts a worker that dies
(the runs it held are reaped by the others, as after any crash). Every worker, restarted ones
too, runs on the config file as the supervisor read it at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentd.settings import ConfigSource, Settings, config_path
from agentd.systemd import sd_notify, stopping
from agentd.waiting import ended_first

log = logging.getLogger("agentd.supervisor")

# The hand-off from supervisor to worker, in the worker's environment (never on its argv).
SOCKETS_ENV = "AGENTD_WORKER_SOCKETS"  # comma-separated inherited file descriptors
READY_FD_ENV = "AGENTD_WORKER_READY_FD"  # the worker writes READY=1 here once it serves
SLOT_ENV = "AGENTD_WORKER_SLOT"  # 1..N, for its log lines
# The fingerprint of the self-signed certificate the supervisor loaded: every worker serves it.
FINGERPRINT_ENV = "AGENTD_WORKER_FINGERPRINT"
# "stdin": the supervisor's config text follows on the worker's stdin; "none": it read no file.
# On stdin, not in the environment: the text may hold secrets, and a worker's environment is
# inherited by the programs it starts (MCP servers).
CONFIG_ENV = "AGENTD_WORKER_CONFIG"
READY = b"READY=1\n"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # each starts the drain
# Stop and cancel the turns still running: an operator's, or a supervisor's to its workers.
HURRY_SIGNAL = signal.SIGUSR1

RESTART_MIN_S = 0.5
RESTART_MAX_S = 30.0
FAILING_AFTER = 3  # exits in a row before systemd's status line names the worker
STABLE_S = 10.0  # a worker that served this long restarts after RESTART_MIN_S; else it backs off
STOP_MARGIN_S = 30.0  # beyond drain_s, before a worker that does not exit is killed
# Beyond the workers' stop, for the embedded PostgreSQL's own: pg_ctl waits up to 60 s for
# the fast shutdown's checkpoint, and is given 30 s more (embedded_pg/server.py).
DATABASE_STOP_S = 90.0
# Connections a worker opens besides its pool: the hub's LISTEN and the heartbeat's.
WORKER_OWN_CONNECTIONS = 2
CROWDED = "too many workers for the server's connections"


def on_stop_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event,
                    hurry: asyncio.Event | None = None, *,
                    supervised: bool = False) -> None:
    """SIGTERM, SIGINT and SIGHUP (a closed terminal) set `stop`, which starts the drain. A SIGHUP
    this process was started ignoring (`nohup agentd serve`) stays ignored.

    `hurry` cuts the drain short: the turns still running are cancelled at once, as when the
    drain's time is up. HURRY_SIGNAL sets it (and `stop`) whenever it comes; so does a second
    Ctrl-C, a SIGINT while the stop is under way, except in a supervised worker, whose
    supervisor passes the hurry on as HURRY_SIGNAL. Repeated SIGTERMs and SIGHUPs never hurry:
    one stop often reaches a process twice (a closing terminal's shell and its kernel both send
    SIGHUP; systemd's default KillMode, a container's init or a terminal signal the whole group,
    workers included, and the supervisor passes the stop on too)."""

    def received(signum: int) -> None:
        if signum == signal.SIGINT and stop.is_set() and not supervised:
            hurried(signum)
        stop.set()

    def hurried(signum: int) -> None:
        if hurry is not None and not hurry.is_set():
            log.warning("cancelling the turns still running",
                        extra={"signal": signal.Signals(signum).name})
            hurry.set()
        stop.set()

    for signum in STOP_SIGNALS:
        if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
            continue
        loop.add_signal_handler(signum, received, signum)
    loop.add_signal_handler(HURRY_SIGNAL, hurried, HURRY_SIGNAL)


def worker_count(settings: Settings) -> int:
    """`workers`, or 0 = one per CPU this process may use (its affinity, and a cgroup's quota,
    as a container or a systemd CPUQuota= sets one)."""
    if settings.workers > 0:
        return settings.workers
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup"),
                     membership: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPUs a cgroup quota allows this process (the tightest of its cgroup and their
    parents), None without one. Written here because neither `os` nor psutil reads the quota:
    both count the CPUs a process may be scheduled on, which a quota does not narrow."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue  # not a membership line: nothing to read a quota from
        _, controllers, path = fields
        if controllers == "":  # cgroup v2: "0::/path", the quota in cpu.max
            limits += _quotas(root, path, lambda d: _v2_quota(d / "cpu.max"))
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            base = root / controllers
            limits += _quotas(base if base.is_dir() else root / "cpu", path, _v1_quota)
    return min(limits, default=None)


def _quotas(base: Path, path: str, quota: Any) -> list[float]:
    """The quotas set on `path` and every parent up to `base` (a container sees its own
    cgroup as the root, where the path it is told may not exist: those levels are skipped)."""
    found: list[float] = []
    level = base / path.strip("/")
    while True:
        value = quota(level)
        if value is not None:
            found.append(value)
        if level == base or base not in level.parents:
            return found
        level = level.parent


def _v2_quota(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(level: Path) -> float | None:
    try:
        quota = int((level / "cpu.cfs_quota_us").read_text())
        period = int((level / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def fit_workers(count: int, settings: Settings, budget: int) -> tuple[int, str | None]:
    """How many workers to start within the server's connection budget, and what to tell the
    operator (None when all fit).

    Each worker's pool may grow to pool_max (behind a transaction pooler, the pooler holds
    those), plus its own connections. A count the operator chose that does not fit is refused
    (0 workers); the default one is lowered to what fits, at least one."""
    each = (0 if settings.pooled else settings.pool_max) + WORKER_OWN_CONNECTIONS
    fits = max(0, budget) // each
    if count <= fits:
        return count, None
    parts = "its LISTEN and heartbeat; its pool goes through the pooler" if settings.pooled \
        else f"pool_max {settings.pool_max}, its LISTEN and heartbeat"
    why = (f"{count} workers need up to {count * each} connections ({each} each: {parts}), "
           f"but the server lets agentd open {budget}")
    if settings.workers > 0:
        return 0, f"{why}: lower workers or pool_max, or raise max_connections"
    return max(1, fits), f"{why}: starting {max(1, fits)}"


def config_from_supervisor(config_file: Path | None) -> ConfigSource | None:
    """In a supervised worker, the config file as its supervisor read it (else None)."""
    how = os.environ.pop(CONFIG_ENV, None)
    if how is None:
        return None
    path, _ = config_path(config_file)
    text = sys.stdin.buffer.read().decode("utf-8") if how == "stdin" else None
    return ConfigSource(path, text)


@dataclass(frozen=True)
class Handoff:
    """What a supervised worker received: the bound sockets and where to report readiness."""

    sockets: list[socket.socket]
    ready_fd: int
    slot: int
    parent_pid: int
    # The self-signed certificate the fleet serves (None: plain HTTP, or a configured one).
    fingerprint: str | None = None

    def report_ready(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.ready_fd, READY)
            os.close(self.ready_fd)


def handoff_from_environment() -> Handoff | None:
    """The hand-off when this process was started by a supervisor, else None."""
    fds = os.environ.pop(SOCKETS_ENV, None)
    ready = os.environ.pop(READY_FD_ENV, None)
    slot = os.environ.pop(SLOT_ENV, "0")
    fingerprint = os.environ.pop(FINGERPRINT_ENV, None) or None
    if not fds or ready is None:
        return None
    sockets = [socket.socket(fileno=int(fd)) for fd in fds.split(",")]
    for sock in sockets:
        os.set_inheritable(sock.fileno(), False)  # a worker's own children never hold the port
    return Handoff(sockets, int(ready), int(slot), os.getppid(), fingerprint)


async def watch_parent(handoff: Handoff, stop: asyncio.Event) -> None:
    """A worker whose supervisor is gone (killed -9) drains and exits rather than linger."""
    while not stop.is_set():
        if os.getppid() != handoff.parent_pid:
            log.warning("the supervisor is gone: draining")
            stop.set()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


class StartFailed(Exception):
    """A worker exited before it served on the first start (its log says why)."""


@dataclass
class Worker:
    slot: int
    process: asyncio.subprocess.Process
    started: float
    ready: asyncio.Future[bool]


class Fleet:
    """N worker processes on the inherited sockets, kept at N until told to stop."""

    def __init__(self, settings: Settings, dsn: str, sockets: list[socket.socket], count: int,
                 config: ConfigSource, fingerprint: str | None = None) -> None:
        self.settings = settings
        self.fingerprint = fingerprint
        self.dsn = dsn
        self.sockets = sockets
        self.count = count
        self.config = config
        self.workers: dict[int, Worker] = {}
        self.restarts = 0
        self.failing: dict[int, int] = {}  # slot -> exits in a row before it served for long
        self._handing: set[asyncio.Task[None]] = set()  # config hand-offs under way

    def _command(self) -> list[str]:
        # --config only names the file in messages: the text comes on stdin (CONFIG_ENV).
        return [sys.executable, "-m", "agentd", "serve", "--config", str(self.config.path)]

    def _environment(self, slot: int, ready_fd: int) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # only the supervisor talks to systemd
        settings = self.settings
        env.update({
            "AGENTD_DSN": self.dsn, "AGENTD_LISTEN": settings.listen, "AGENTD_WORKERS": "1",
            "AGENTD_INSECURE_HTTP": "true" if settings.insecure_http else "false",
            CONFIG_ENV: "none" if self.config.text is None else "stdin",
            SOCKETS_ENV: ",".join(str(s.fileno()) for s in self.sockets),
            READY_FD_ENV: str(ready_fd), SLOT_ENV: str(slot)})
        if settings.data_dir is not None:
            env["AGENTD_DATA_DIR"] = str(settings.data_dir)
        if self.fingerprint is not None:
            env[FINGERPRINT_ENV] = self.fingerprint
        return env

    async def spawn(self, slot: int) -> Worker:
        loop = asyncio.get_running_loop()
        read_fd, write_fd = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                *self._command(), stdin=asyncio.subprocess.PIPE,
                env=self._environment(slot, write_fd),
                pass_fds=[*(s.fileno() for s in self.sockets), write_fd])
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        ready: asyncio.Future[bool] = loop.create_future()

        def readable() -> None:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                data = b""
            loop.remove_reader(read_fd)
            os.close(read_fd)
            if not ready.done():
                ready.set_result(data.startswith(READY))

        loop.add_reader(read_fd, readable)
        worker = Worker(slot, process, time.monotonic(), ready)
        self.workers[slot] = worker
        # Handed over beside the rest, not awaited: a worker that stalls before reading a
        # config larger than the pipe holds must not stall the supervisor (a stop ends it).
        handing = loop.create_task(self._hand_config(process))
        self._handing.add(handing)
        handing.add_done_callback(self._handing.discard)
        log.info("worker started", extra={"slot": slot, "pid": process.pid})
        return worker

    async def _hand_config(self, process: asyncio.subprocess.Process) -> None:
        """The config text on the worker's stdin, then end of file. A worker that died at once
        has closed its end: its exit is seen and handled as any other."""
        stdin = process.stdin
        assert stdin is not None
        try:
            if self.config.text is not None:
                stdin.write(self.config.text.encode("utf-8"))
                await stdin.drain()
        except ConnectionError:
            pass
        finally:
            stdin.close()  # end of file, also when a stop cut the hand-off short

    async def start(self, stop: asyncio.Event) -> bool:
        """Start every worker; True once all serve, False when `stop` came first.
        StartFailed when one exits (or says it failed) before it served."""
        stopping = asyncio.ensure_future(stop.wait())
        try:
            for slot in range(1, self.count + 1):
                try:
                    await self.spawn(slot)
                except OSError as exc:  # no process could be made (fork or file limits)
                    raise StartFailed(f"worker {slot} could not be started: {exc}") from None
            for worker in self.workers.values():
                exited = asyncio.ensure_future(worker.process.wait())
                waits: set[asyncio.Future[Any]] = {worker.ready, exited, stopping}
                try:
                    done, _ = await asyncio.wait(waits,
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    exited.cancel()
                if stop.is_set():
                    return False
                if not (worker.ready in done and worker.ready.result()):
                    code = await worker.process.wait()
                    raise StartFailed(f"worker {worker.slot} exited with {code} before it served")
            return True
        finally:
            stopping.cancel()

    async def keep(self, stop: asyncio.Event) -> None:
        """Restart any worker that exits, each slot on its own (one backing off does not delay
        another's restart), until `stop` is set."""
        async with asyncio.TaskGroup() as group:  # a failing keeper stops the others
            for slot in list(self.workers):
                group.create_task(self._keep_slot(slot, stop))

    async def _keep_slot(self, slot: int, stop: asyncio.Event) -> None:
        backoff = RESTART_MIN_S
        while not stop.is_set():
            worker = self.workers[slot]
            if not await ended_first(worker.process.wait(), stop):
                return
            lived = time.monotonic() - worker.started
            served = worker.ready.done() and worker.ready.result()
            if lived >= STABLE_S and served:
                backoff = RESTART_MIN_S
                self.failing.pop(slot, None)
            else:
                self.failing[slot] = self.failing.get(slot, 0) + 1
            log.warning("worker exited; restarting it", extra={
                "slot": slot, "pid": worker.process.pid, "code": worker.process.returncode,
                "after_s": backoff, "exits_in_a_row": self.failing.get(slot, 0)})
            self._report()
            while True:
                if not await ended_first(asyncio.sleep(backoff), stop):
                    return
                backoff = min(RESTART_MAX_S, backoff * 2)
                try:
                    replacement = await self.spawn(slot)
                except OSError as exc:  # no process could be made (fork limits): later
                    log.error("could not start a worker: trying again", extra={
                        "slot": slot, "reason": str(exc), "after_s": backoff})
                    continue
                break
            self.restarts += 1
            replacement.ready.add_done_callback(functools.partial(self._served, replacement))

    def _served(self, worker: Worker, _ready: asyncio.Future[bool]) -> None:
        if worker.ready.result():
            log.info("worker serving", extra={"slot": worker.slot, "pid": worker.process.pid})
            self._report()

    def _report(self) -> None:
        """systemd's status line: how many serve, and a worker that keeps failing."""
        serving = {w.slot for w in self.workers.values()
                   if w.process.returncode is None and w.ready.done() and w.ready.result()}
        status = f"serving with {len(serving)} of {self.count} workers"
        failing = [f"worker {slot} exited {n} times in a row"
                   for slot, n in sorted(self.failing.items())
                   if n >= FAILING_AFTER and slot not in serving]
        sd_notify("STATUS=" + "; ".join([status, *failing]))

    def signal_all(self, signum: int) -> None:
        for worker in self.workers.values():
            if worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signum)

    async def stop(self, budget_s: float, hurry: asyncio.Event | None = None) -> bool:
        """SIGTERM every live worker (each drains), wait up to `budget_s`, kill the rest. Once
        `hurry` is set (a second Ctrl-C, or SIGUSR1), HURRY_SIGNAL to each: it cuts its drain short.

        True when each stopped cleanly: exited 0, or ended by a stop signal or HURRY_SIGNAL
        itself (a worker still starting has no handler yet, and holds no turn; a terminal's
        Ctrl-C or hang-up reaches the workers too, as they share its process group). A worker
        that had died before the stop was already restarted or being restarted, and is not
        counted again."""
        for handing in list(self._handing):
            handing.cancel()
        live = [w for w in self.workers.values() if w.process.returncode is None]
        self.signal_all(signal.SIGTERM)
        try:
            async with asyncio.timeout(budget_s):
                exits = asyncio.gather(*(w.process.wait() for w in live))
                if hurry is not None and not await ended_first(asyncio.shield(exits), hurry):
                    self.signal_all(HURRY_SIGNAL)
                codes = await exits
        except TimeoutError:
            log.error("workers did not finish their drain in time: killing them",
                      extra={"seconds": budget_s})
            self.signal_all(signal.SIGKILL)
            await asyncio.gather(*(w.process.wait() for w in self.workers.values()))
            return False
        return all(code == 0 or -code in (*STOP_SIGNALS, HURRY_SIGNAL) for code in codes)



async def supervise(settings: Settings, count: int, config: ConfigSource) -> int:
    """The supervisor's whole life; returns the exit code."""
    from agentd import db as dbmod
    from agentd.listen import bind_listen_sockets, claim
    from agentd.startup import (
        ensure_local_client,
        migrate_database,
        open_database,
        raise_open_files_limit,
        unless_stopped,
    )
    from agentd.tls import local_url, say_expiry, server_certificate

    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    on_stop_signals(loop, stop, hurry)
    sockets = bind_listen_sockets(settings.listen_host, settings.listen_port)
    try:
        # Made once here, so N workers starting together only ever load it.
        certificate = await asyncio.to_thread(server_certificate, settings) \
            if settings.serves_tls else None
        say_expiry(certificate)
        raise_open_files_limit(settings.max_connections + 256)
        database = await open_database(settings)
        try:
            applied = await unless_stopped(
                stop, migrate_database(settings.direct_dsn(database.dsn)),
                "waiting to migrate the database")
            if applied:
                log.info("migrations applied", extra={"applied": ",".join(applied)})
            count, crowded = fit_workers(count, settings,
                                         await connection_budget(settings.direct_dsn(
                                             database.dsn)))
            if crowded:
                log.log(logging.ERROR if count == 0 else logging.WARNING, CROWDED,
                        extra={"reason": crowded})
            if count == 0:
                return 2
            pool = await dbmod.create_pool(database.dsn, min_size=1, max_size=1,
                                           pooled=settings.pooled)
            try:
                await ensure_local_client(pool, local_url(settings),
                                          certificate.fingerprint if certificate else None,
                                          create=database.embedded is not None)
            finally:
                await pool.close()
            claim(sockets, settings.listen_host, settings.listen_port)
            fingerprint = certificate.fingerprint if certificate else None
            # The self-signed certificate is every worker's, as devices pinned it: a worker
            # restarted after it changed on disk does not serve another. A configured one is
            # renewed on disk (certbot) and trusted through its CA: a restarted worker serves
            # the renewal.
            pinned = fingerprint if certificate and certificate.self_signed else None
            return await _run_fleet(Fleet(settings, database.dsn, sockets, count, config,
                                          pinned),
                                    stop, hurry, fingerprint,
                                    embedded=database.embedded is not None)
        finally:
            await asyncio.to_thread(database.close, service=True)
    finally:
        for sock in sockets:
            sock.close()


async def _run_fleet(fleet: Fleet, stop: asyncio.Event, hurry: asyncio.Event,
                     fingerprint: str | None, *, embedded: bool) -> int:
    """Start, keep and stop the workers; whatever happens, no worker outlives this (the
    database they write to is stopped right after)."""
    settings = fleet.settings
    budget = settings.drain_s + STOP_MARGIN_S
    code = 1
    try:
        try:
            started = await fleet.start(stop)
        except StartFailed as exc:
            log.error("a worker could not start: stopping", extra={"reason": str(exc)})
            return 1
        if started:
            log.info("agentd serving", extra={
                "url": f"{'https' if fingerprint else 'http'}://{settings.listen}",
                "workers": fleet.count,
                "pids": ",".join(str(w.process.pid) for w in fleet.workers.values()),
                "embedded": embedded, "fingerprint": fingerprint})
            sd_notify(f"READY=1\nSTATUS=serving with {fleet.count} workers")
            await fleet.keep(stop)
        code = 0
    finally:
        stop.set()  # also when a failure ends it: a Ctrl-C from here on cuts the stop short
        # Said once the supervisor holds the stop: a second Ctrl-C sent before then can merge
        # with the first while this process waits for a CPU (the kernel keeps one of each).
        log.info("stopping the workers", extra={
            "to_cancel_their_turns_now": "Ctrl-C again, or SIGUSR1"})
        stopping(budget + DATABASE_STOP_S)
        begun = time.monotonic()
        clean = await fleet.stop(budget, hurry)
        log.info("workers stopped", extra={"clean": clean, "restarts": fleet.restarts,
                                           "seconds": round(time.monotonic() - begun, 3)})
    return code if clean else 1


async def connection_budget(dsn: str) -> int:
    from agentd import db as dbmod

    conn = await dbmod.connect(dsn, application_name="agentd-supervisor")
    try:
        return await dbmod.connection_budget(conn)
    finally:
        await conn.close()
