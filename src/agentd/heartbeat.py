"""The heartbeat: one beat per process renews every lease it holds, on a connection of its own.

Each beat is ONE statement (queue.beat): every held run is renewed behind its own claim token,
and the process's worker row with it, so however many turns run, the leases cost one round trip
per heartbeat_s, and no wait for a pooled connection can make a beat late. A run that comes back
lost is told at once (its turn stops and writes nothing more); its cancel flag comes back with
the beat, and a cancel hint for a held run (or heard for it just before it was held) triggers a
beat at once, so stops land within a beat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from uuid import UUID

import asyncpg

from agentd import db as dbmod
from agentd.db import DB_ERRORS
from agentd.hub import RECONNECTED, Hub, Subscription
from agentd.metrics import Metrics
from agentd.queue import (
    Beat,
    Claim,
    WorkerReport,
    beat,
    renew_leases_waiting,
    retire_worker,
)
from agentd.settings import Settings
from agentd.vocabulary import Channel

log = logging.getLogger("agentd.heartbeat")

RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.4)  # after a failed beat; then every RETRY_CAP_S at most
RETRY_CAP_S = 1.0
# How long the retry of a locked run may wait for its row (a mid-append lock lasts milliseconds;
# a transaction frozen with its process must not hold up the next beat).
STRAGGLER_LOCK_TIMEOUT_MS = 500
# How long a stop hint for a run this process does not hold is remembered: a turn claimed beside
# its post is held moments after that post committed, and nothing reads its cancel flag in
# between (its transcript came with the claim), so a stop committed meanwhile is only known
# from its hint. Long enough for any such turn to be held, short enough to stay small.
UNHELD_STOP_MEMORY_S = 10.0


@dataclass(eq=False)
class HeldRun:
    """A run this process executes, as the heartbeat keeps it: the executor waits on the two
    events, and marks `finishing` just before its terminal write (a beat that finds the run
    ended then is no news)."""

    claim: Claim
    lease_expires_at: datetime
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    finishing: bool = False


class LeaseKeeper:
    """Holds the runs of one process and renews them together every heartbeat_s."""

    def __init__(self, dsn: str, hub: Hub, settings: Settings, metrics: Metrics,
                 report: Callable[[], WorkerReport]) -> None:
        self._dsn = dsn
        self._hub = hub
        self._settings = settings
        self._metrics = metrics
        self._report = report
        self._held: dict[UUID, HeldRun] = {}
        # Stop hints heard for runs not held (yet), with when they were heard.
        self._unheld_stops: dict[str, float] = {}
        self._beat_due = False  # a run held after its stop hint was heard: beat at once
        self._beat_now: asyncio.Future[None] | None = None  # wakes the wait for the next beat
        self._conn: asyncpg.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        self.beats = 0

    def __len__(self) -> int:
        return len(self._held)

    @property
    def attempt_s(self) -> float:
        """How long one beat may take, connecting included (half a lease)."""
        return self._settings.lease_ttl_s / 2

    def start(self) -> None:
        self._task = asyncio.create_task(self._beat_forever(), name="agentd-heartbeat")

    async def close(self, *, retire: bool = True) -> None:
        """Stop beating; with `retire`, take this process off the fleet's list at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if retire:
            with contextlib.suppress(*DB_ERRORS):
                async with asyncio.timeout(2.0):
                    await retire_worker(await self._connection(), self._report().worker_id)
        await self._disconnect()

    def hold(self, claim: Claim) -> HeldRun:
        """Keep this run's lease from now on (the claim granted a full one). A stop hint heard
        for it before now makes the next beat come at once (the flag is read from the row)."""
        held = HeldRun(claim, claim.lease_expires_at)
        if claim.cancel_requested:
            held.cancel.set()
        self._held[claim.run_id] = held
        if self._unheld_stops.pop(str(claim.run_id), None) is not None:
            self._beat_due = True
            if self._beat_now is not None and not self._beat_now.done():
                self._beat_now.set_result(None)
        return held

    def release(self, run_id: UUID) -> None:
        self._held.pop(run_id, None)

    # -- the loop ---------------------------------------------------------------------------

    async def _beat_forever(self) -> None:
        loop = asyncio.get_running_loop()
        async with self._hub.subscribe(Channel.RUN_CANCEL) as cancels:
            due = loop.time()
            while True:
                await self._until(due, cancels)
                started = loop.time()
                if await self._beat_once():
                    self._failures = 0
                    due = started + self._settings.heartbeat_s
                else:
                    delay = RETRY_DELAYS_S[self._failures] \
                        if self._failures < len(RETRY_DELAYS_S) else RETRY_CAP_S
                    self._failures += 1
                    due = loop.time() + min(delay, self._settings.heartbeat_s)

    async def _until(self, due: float, cancels: Subscription) -> None:
        """Wait for the next beat: its time, or a stop hint for a run we hold (beat at once:
        the flag is re-read from the row, never taken from the hint), or such a run held after
        its stop hint was heard."""
        loop = asyncio.get_running_loop()
        self._beat_now = loop.create_future()
        try:
            while not self._beat_due and (left := due - loop.time()) > 0:
                hints = await cancels.wait(left, until=self._beat_now)
                held = self._held_keys()
                self._remember_unheld(hints - held - {RECONNECTED}, loop.time())
                if RECONNECTED in hints or hints & held:
                    return
        finally:
            self._beat_due = False
            self._beat_now.cancel()
            self._beat_now = None

    def _remember_unheld(self, hints: set[str], now: float) -> None:
        for run_id, heard in list(self._unheld_stops.items()):
            if now - heard > UNHELD_STOP_MEMORY_S:
                del self._unheld_stops[run_id]
        for hint in hints:
            self._unheld_stops[hint] = now

    def _held_keys(self) -> set[str]:
        return {str(run_id) for run_id in self._held}

    async def _beat_once(self) -> bool:
        held = list(self._held.values())
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            # Half a lease at most, connecting included: a beat sent over a link that died
            # silently is given up in time for a retry on a new connection to land before the
            # leases lapse (a bound of a whole lease left none), while a slow database still
            # has long enough to answer.
            async with asyncio.timeout(self.attempt_s):
                conn = await self._connection()
                result = await beat(conn, self._report(), [h.claim for h in held],
                                    self._settings.lease_ttl_s)
                renewed = dict(result.renewed)
                lost = list(result.lost)
                if result.busy:
                    late = await self._renew_stragglers(conn, [
                        h for h in held if h.claim.run_id in set(result.busy)])
                    renewed.update(late.renewed)
                    lost.extend(late.lost)
        except DB_ERRORS as exc:
            self._metrics.beat_failures.inc()
            log.warning("heartbeat failed; retrying on a new connection (the database decides "
                        "whether a lease lapsed)", extra={"error": str(exc) or type(exc).__name__,
                                                         "runs": len(held)})
            await self._disconnect()
            return False
        self.beats += 1
        self._metrics.beats.inc()
        self._metrics.beat_seconds.observe(loop.time() - started)
        for run_id, fresh in renewed.items():
            self._renewed(run_id, fresh)
        for run_id in lost:
            self._lost(run_id)
        return True

    async def _renew_stragglers(self, conn: asyncpg.Connection,
                                held: list[HeldRun]) -> _Late:
        """Runs whose row was locked during the beat: renew them waiting for their locks, all
        together, else one by one (so one row a frozen transaction holds delays only itself)."""
        late = _Late({}, [])
        claims = [h.claim for h in held]
        try:
            renewed = await renew_leases_waiting(conn, claims, self._settings.lease_ttl_s)
        except asyncpg.LockNotAvailableError:
            if len(claims) == 1:
                return late  # still held: the next beat tries again
            for claim in claims:
                with contextlib.suppress(asyncpg.LockNotAvailableError):
                    one = await renew_leases_waiting(conn, [claim],
                                                     self._settings.lease_ttl_s)
                    late.renewed.update(one)
                    if claim.run_id not in one:
                        late.lost.append(claim.run_id)
            return late
        late.renewed.update(renewed)
        late.lost.extend(c.run_id for c in claims if c.run_id not in renewed)
        return late

    def _renewed(self, run_id: UUID, fresh: Beat) -> None:
        held = self._held.get(run_id)
        if held is None:
            return  # released while the beat was in flight
        held.lease_expires_at = fresh.lease_expires_at
        if fresh.cancel_requested:
            held.cancel.set()

    def _lost(self, run_id: UUID) -> None:
        held = self._held.pop(run_id, None)
        if held is None or held.finishing:
            return  # ended by its own terminal write while the beat ran: no news
        self._metrics.leases_lost.inc()
        log.warning("lease lost: the run is no longer ours; its turn stops and writes nothing "
                    "more", extra={"run_id": str(run_id), "fence": held.claim.fence})
        held.lost.set()

    # -- the reserved connection --------------------------------------------------------------

    async def _connection(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            # Outside the pool, so a beat never queues behind the turns' own writes. Bounded
            # lock and statement waits: a beat either lands within the lease or is retried.
            self._conn = await dbmod.connect(
                self._dsn, application_name="agentd-heartbeat",
                timeouts=dbmod.DbTimeouts(
                    lock_timeout_ms=STRAGGLER_LOCK_TIMEOUT_MS,
                    statement_timeout_ms=int(self.attempt_s * 1000)))
        return self._conn

    async def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None or conn.is_closed():
            return
        try:
            await asyncio.wait_for(conn.close(), timeout=1.0)
        except DB_ERRORS:
            conn.terminate()
        except asyncio.CancelledError:
            conn.terminate()
            raise


@dataclass(frozen=True, slots=True)
class _Late:
    renewed: dict[UUID, Beat]
    lost: list[UUID]
