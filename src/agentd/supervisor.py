"""`agentd serve --workers N`: one small supervisor, N full agentd worker processes, one port.

The supervisor binds the listen address once, owns the embedded PostgreSQL, migrates, makes the
certificate and the local client's token, then starts N workers that inherit the bound socket
(each accepts from it: one port, every core). Workers coordinate through the database as any
fleet does. The supervisor reports READY to systemd once every worker serves, fans SIGTERM and
SIGINT out for each worker's own two-phase drain, and restarts a worker that dies (the runs it
held are reaped by the others, as after any crash).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentd.settings import Settings

log = logging.getLogger("agentd.supervisor")

# The hand-off from supervisor to worker, in the worker's environment (never on its argv).
SOCKETS_ENV = "AGENTD_WORKER_SOCKETS"  # comma-separated inherited file descriptors
READY_FD_ENV = "AGENTD_WORKER_READY_FD"  # the worker writes READY=1 here once it serves
SLOT_ENV = "AGENTD_WORKER_SLOT"  # 1..N, for its log lines
READY = b"READY=1\n"

RESTART_MIN_S = 0.5
RESTART_MAX_S = 30.0
STABLE_S = 10.0  # a worker that lived this long restarts at once; one that did not, backs off
STOP_MARGIN_S = 30.0  # beyond drain_s, before a worker that does not exit is killed


def worker_count(settings: Settings) -> int:
    """`workers`, or 0 = one per core this process may run on."""
    if settings.workers > 0:
        return settings.workers
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Handoff:
    """What a supervised worker received: the bound sockets and where to report readiness."""

    sockets: list[socket.socket]
    ready_fd: int
    slot: int
    parent_pid: int

    def report_ready(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.ready_fd, READY)
            os.close(self.ready_fd)


def handoff_from_environment() -> Handoff | None:
    """The hand-off when this process was started by a supervisor, else None."""
    fds = os.environ.pop(SOCKETS_ENV, None)
    ready = os.environ.pop(READY_FD_ENV, None)
    slot = os.environ.pop(SLOT_ENV, "0")
    if not fds or ready is None:
        return None
    sockets = [socket.socket(fileno=int(fd)) for fd in fds.split(",")]
    for sock in sockets:
        os.set_inheritable(sock.fileno(), False)  # a worker's own children never hold the port
    return Handoff(sockets, int(ready), int(slot), os.getppid())


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
                 config_file: Path | None) -> None:
        self.settings = settings
        self.dsn = dsn
        self.sockets = sockets
        self.count = count
        self.config_file = config_file
        self.workers: dict[int, Worker] = {}
        self.restarts = 0
        self._stopping = False

    def _command(self) -> list[str]:
        command = [sys.executable, "-m", "agentd", "serve"]
        if self.config_file is not None:
            command += ["--config", str(self.config_file)]
        return command

    def _environment(self, slot: int, ready_fd: int) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # only the supervisor talks to systemd
        settings = self.settings
        env.update({
            "AGENTD_DSN": self.dsn, "AGENTD_LISTEN": settings.listen, "AGENTD_WORKERS": "1",
            "AGENTD_INSECURE_HTTP": "true" if settings.insecure_http else "false",
            SOCKETS_ENV: ",".join(str(s.fileno()) for s in self.sockets),
            READY_FD_ENV: str(ready_fd), SLOT_ENV: str(slot)})
        if settings.data_dir is not None:
            env["AGENTD_DATA_DIR"] = str(settings.data_dir)
        return env

    async def spawn(self, slot: int) -> Worker:
        loop = asyncio.get_running_loop()
        read_fd, write_fd = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                *self._command(), stdin=asyncio.subprocess.DEVNULL,
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
        log.info("worker started", extra={"slot": slot, "pid": process.pid})
        return worker

    async def start(self) -> None:
        """Start every worker; return once all serve. StartFailed if one exits first."""
        workers = [await self.spawn(slot) for slot in range(1, self.count + 1)]
        for worker in workers:
            exited: asyncio.Future[int] = asyncio.ensure_future(worker.process.wait())
            waits: set[asyncio.Future[Any]] = {worker.ready, exited}
            done, _ = await asyncio.wait(waits,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not (worker.ready in done and worker.ready.result()):
                code = await worker.process.wait()
                raise StartFailed(f"worker {worker.slot} exited with {code} before it served")
            exited.cancel()

    async def keep(self, stop: asyncio.Event) -> None:
        """Restart any worker that exits until `stop` is set."""
        backoff = {slot: RESTART_MIN_S for slot in self.workers}
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                waits = {asyncio.ensure_future(w.process.wait()): w
                         for w in self.workers.values()}
                done, _ = await asyncio.wait({stopping, *waits},
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in waits:
                    if task not in done:
                        task.cancel()
                if stop.is_set():
                    return
                for task in done:
                    if task is stopping:
                        continue
                    worker = waits[task]
                    lived = time.monotonic() - worker.started
                    delay = RESTART_MIN_S if lived >= STABLE_S else backoff[worker.slot]
                    backoff[worker.slot] = RESTART_MIN_S if lived >= STABLE_S else \
                        min(RESTART_MAX_S, backoff[worker.slot] * 2)
                    log.warning("worker exited; restarting it", extra={
                        "slot": worker.slot, "pid": worker.process.pid,
                        "code": worker.process.returncode, "after_s": delay})
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                    if stop.is_set():
                        return
                    self.restarts += 1
                    await self.spawn(worker.slot)
        finally:
            stopping.cancel()

    def signal_all(self, signum: int) -> None:
        for worker in self.workers.values():
            if worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signum)

    async def stop(self, budget_s: float) -> bool:
        """SIGTERM every worker (each drains), wait up to `budget_s`, kill the rest.

        True when every worker exited 0.
        """
        self.signal_all(signal.SIGTERM)
        waits = [w.process.wait() for w in self.workers.values()]
        try:
            async with asyncio.timeout(budget_s):
                codes = await asyncio.gather(*waits)
        except TimeoutError:
            log.error("workers did not finish their drain in time: killing them",
                      extra={"seconds": budget_s})
            self.signal_all(signal.SIGKILL)
            await asyncio.gather(*(w.process.wait() for w in self.workers.values()))
            return False
        return all(code == 0 for code in codes)


async def supervise(settings: Settings, count: int, config_file: Path | None) -> int:
    """The supervisor's whole life; returns the exit code."""
    from agentd import db as dbmod
    from agentd.listen import bind_listen_sockets
    from agentd.startup import (
        ensure_local_client,
        migrate_database,
        open_database,
        raise_open_files_limit,
    )
    from agentd.systemd import sd_notify
    from agentd.tls import local_url, server_certificate

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sockets = bind_listen_sockets(settings.listen_host, settings.listen_port)
    try:
        # Made once here, so N workers starting together only ever load it.
        certificate = await asyncio.to_thread(server_certificate, settings) \
            if settings.serves_tls else None
        raise_open_files_limit(settings.max_connections + 256)
        database = await open_database(settings)
        try:
            applied = await migrate_database(settings.direct_dsn(database.dsn))
            if applied:
                log.info("migrations applied", extra={"applied": ",".join(applied)})
            pool = await dbmod.create_pool(database.dsn, min_size=1, max_size=1,
                                           pooled=settings.pooled)
            try:
                await ensure_local_client(pool, local_url(settings),
                                          certificate.fingerprint if certificate else None,
                                          create=database.embedded is not None)
            finally:
                await pool.close()
            fleet = Fleet(settings, database.dsn, sockets, count, config_file)
            try:
                await fleet.start()
            except StartFailed as exc:
                log.error("a worker could not start: stopping", extra={"reason": str(exc)})
                await fleet.stop(settings.drain_s + STOP_MARGIN_S)
                return 1
            scheme = "https" if certificate else "http"
            log.info("agentd serving", extra={
                "url": f"{scheme}://{settings.listen}", "workers": count,
                "pids": ",".join(str(w.process.pid) for w in fleet.workers.values()),
                "embedded": database.embedded is not None,
                "fingerprint": certificate.fingerprint if certificate else None})
            sd_notify(f"READY=1\nSTATUS=serving with {count} workers")
            await fleet.keep(stop)
            sd_notify("STOPPING=1")
            started = time.monotonic()
            clean = await fleet.stop(settings.drain_s + STOP_MARGIN_S)
            log.info("workers stopped", extra={"clean": clean, "restarts": fleet.restarts,
                                               "seconds": round(time.monotonic() - started, 3)})
            return 0 if clean else 1
        finally:
            await asyncio.to_thread(database.close)
    finally:
        for sock in sockets:
            sock.close()
