"""The claim loop: take a concurrency slot, wait until the load admits more, then claim, then
run the turn in its own task.

The semaphore is acquired before the claim (claims are one statement, semaphore first:
docs/architecture.md), so a saturated process never strands a run it has no capacity for; admission
by capacity (load.py) holds back while the event loop lags or the pool waits, so overload leaves
turns queued instead of claiming ones it cannot keep alive. Idle, it waits on the hub's run_enqueued
hint with the tick as timeout. However a turn's task ends, the dispatcher makes sure its run is
finalized (the backstop).

A turn posted to a process with a free slot need not wait for the loop: the enqueue reserves the
slot (`reserve`) and claims inside its own transaction, so the turn starts in the commit that
wrote it (docs/architecture.md, "Claim beside the enqueue").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

import asyncpg

from agentd.db import DB_ERRORS
from agentd.failures import RunFailure, failure, log_failure
from agentd.hub import Hub
from agentd.load import LoadMonitor
from agentd.metrics import Metrics
from agentd.queue import (
    Claim,
    ClaimBeside,
    Hint,
    LeaseLost,
    SeqConflict,
    claim_runs,
    ended_after_lost_answer,
    finish_run,
    lost_race,
    wake_claim_loops,
)
from agentd.settings import Settings
from agentd.vocabulary import Channel, RunErrorCode, RunStatus
from agentd.waiting import ended_first

log = logging.getLogger("agentd.dispatcher")

RunTurn = Callable[[Claim], Awaitable[bool]]
DRAIN_FAILURE = failure(RunErrorCode.SHUTDOWN)


class OwedWakes:
    """The wakes of endings that came to this process's claim loop alone (notifier.py): each
    is acted for by a claim sent after its ending committed, or handed on to the fleet.

    A claim acts for as many owed wakes as it took turns, or for all of them when it took
    fewer turns than it had slots for (it found everything claimable). An ending frees at most
    one turn, so a claim with one slot acting for two endings leaves one owed. Times are
    time.monotonic() of this process."""

    def __init__(self) -> None:
        self.owed = 0  # acted for by no claim yet: the loop's next claim, or a hand-on
        self._sent = -math.inf  # when the latest claim was sent
        self._in_flight = False
        self._acting = 0  # owed wakes the claim in flight acts for
        self._spare = 0.0  # the latest finished claim's turns no wake was charged to (inf: it
        # found everything claimable)

    def arrive(self, committed_by: float, wakes: int) -> int:
        """Wakes of endings committed by `committed_by`; returns how many are owed now."""
        if committed_by > self._sent:
            self.owed += wakes  # no claim was sent after them
        elif self._in_flight:
            self._acting += wakes
        else:
            self.owed += self._spend(wakes)
        return self.owed

    def claim_sent(self) -> None:
        """A claim is sent now: it acts for the wakes owed so far, as far as the turns it
        takes go (claim_done)."""
        self._acting, self.owed = self.owed, 0
        self._sent = time.monotonic()
        self._in_flight = True
        self._spare = 0.0

    def claim_done(self, took: int, slots: int) -> None:
        self._in_flight = False
        self._spare = math.inf if took < slots else float(took)
        acting, self._acting = self._acting, 0
        self.owed += self._spend(acting)

    def claim_failed(self) -> int:
        """The claim saw nothing: returns the wakes it was acting for (to hand on). It took no
        turns, so wakes it would have covered that arrive later are owed."""
        self._in_flight = False
        acting, self._acting = self._acting, 0
        return acting

    def take(self) -> int:
        """All owed wakes, to hand on."""
        owed, self.owed = self.owed, 0
        return owed

    def _spend(self, wakes: int) -> int:
        """Acts for `wakes` out of the latest claim's spare turns; returns those left owed."""
        acted = min(float(wakes), self._spare)
        self._spare -= acted
        return wakes - int(acted)


class Dispatcher:
    def __init__(self, pool: asyncpg.Pool, hub: Hub, settings: Settings, worker_id: str,
                 run_turn: RunTurn, load: LoadMonitor, metrics: Metrics,
                 hint: Hint | None = None) -> None:
        self._pool = pool
        self._hint = hint
        self._hub = hub
        self._settings = settings
        self._worker_id = worker_id
        self._run_turn = run_turn
        self._load = load
        self._metrics = metrics
        self._slots = asyncio.Semaphore(settings.max_runs)
        self._loop_task: asyncio.Task[None] | None = None
        self._draining = False
        # Held from a claim's statement until its runs have tasks: a claim that committed must
        # not be cancelled before then, or its runs would sit `running` with nobody executing
        # them until their lease ran out.
        self._claiming = asyncio.Lock()
        self.in_flight: set[asyncio.Task[None]] = set()
        self.claimed = 0
        self._beside: Reservation | None = None  # a claim under way in an enqueue's transaction
        self._beside_settled = asyncio.Event()
        self._beside_settled.set()
        # Endings' wakes that came to this loop alone (notifier.py): each is acted for by a
        # claim sent after its ending committed, or handed on to the fleet, whose loops would
        # otherwise wait for a tick: at once when the loop is parked (no slot, overload), else
        # when it cannot claim or its claim fails.
        self._owed = OwedWakes()
        self._waiting_for: str | None = None  # what the loop is parked on: a slot, the load
        self._handing_on: set[asyncio.Task[None]] = set()

    @property
    def draining(self) -> bool:
        """True from the moment the drain begins: no claim starts after it."""
        return self._draining

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._claim_forever(), name="agentd-dispatcher")

    def claims(self) -> bool:
        """Whether the claim loop will claim now: started, not draining, and not holding back
        for load (an ending's wake then goes to it alone: notifier.py)."""
        return (self._loop_task is not None and not self._loop_task.done()
                and not self._draining and self._load.overload() is None)

    @property
    def waiting_for(self) -> str | None:
        """What the claim loop is parked on: "no free slot", "overloaded", or None."""
        return self._waiting_for

    def owe_wake(self, committed_by: float, wakes: int) -> None:
        """The wakes of `wakes` endings committed by `committed_by` (time.monotonic()) came to
        this loop alone (notifier.py): a claim sent after them acts for them (OwedWakes), or
        the loop hands them on. A loop parked on a slot or on the load hands them on at once;
        any other claims next, or hands them on if it then finds no slot."""
        if self._owed.arrive(committed_by, wakes) and self._waiting_for is not None:
            self._hand_on_soon(self._waiting_for)

    def _hand_on_soon(self, why: str) -> None:
        """Wake every claim loop of the fleet for the ending wakes this loop cannot act on now:
        what the endings freed may start on a process that has a free slot."""
        self._owed.take()
        task = asyncio.get_running_loop().create_task(self._hand_on(why))
        self._handing_on.add(task)
        task.add_done_callback(self._handing_on.discard)

    async def _hand_on(self, why: str) -> None:
        try:
            await wake_claim_loops(self._pool, why)
        except DB_ERRORS as exc:
            log.warning("could not wake the other claim loops", extra={"error": str(exc)})

    async def reserve(self) -> Reservation | None:
        """A free slot for a claim inside the caller's enqueue transaction, or None: claiming
        beside enqueues is off, the drain has begun, no slot is free, the process is
        overloaded, or such a claim is under way here already (one at a time: a burst of
        posts is claimed by the loop, a few turns per statement, which costs less per turn)."""
        if (not self._settings.claim_on_enqueue or self._draining or self._beside is not None
                or self._slots.locked() or self._load.overload() is not None):
            return None
        # Returns at once: a semaphore that is not locked hands out a slot without yielding,
        # so nothing else can take it between the check above and this line.
        await self._slots.acquire()
        self._beside = Reservation(self)
        self._beside_settled.clear()
        return self._beside

    async def stop_claiming(self) -> None:
        """Phase 1 of the drain: returns once the loop is parked (milliseconds, or the end of
        a claim statement already sent, whose runs then join the drain like any other)."""
        self._draining = True
        if self._loop_task is not None:
            async with self._claiming:
                self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        # A claim beside an enqueue already sent commits or not within its short transaction;
        # its runs then join the drain like any other.
        await self._beside_settled.wait()
        # Wakes of this process's endings went to this loop alone while it claimed
        # (notifier.py); one it had not acted on yet would wait for another loop's tick.
        await self._hand_on("drain")
        await asyncio.gather(*self._handing_on, return_exceptions=True)

    async def drain(self, budget_s: float,
                    hurry: asyncio.Event | None = None) -> tuple[int, int]:
        """Phase 2: let in-flight turns finish within the budget, or until `hurry` is set (a
        second Ctrl-C, or SIGUSR1), then cancel the rest.

        Cancelled turns are finalized failed by the backstop (never re-queued); returns
        (finished in time, cancelled).
        """
        tasks = set(self.in_flight)
        if not tasks:
            return 0, 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(budget_s):
                await ended_first(asyncio.wait(tasks), hurry or asyncio.Event())
        pending = {task for task in tasks if not task.done()}
        done = tasks - pending
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)
        return len(done), len(pending)

    async def _claim_forever(self) -> None:
        async with self._hub.subscribe(Channel.RUN_ENQUEUED) as wake:
            while True:
                # Parked on a slot (a post's claim beside its enqueue may have taken the one an
                # ending gave back) or on the load, the loop hands owed wakes on: what the
                # ending freed must not wait for this process.
                await self._park("no free slot", self._slots.locked(), self._slots.acquire())
                try:
                    await self._park("overloaded", self._load.overload() is not None,
                                     self._load.admitted())
                except asyncio.CancelledError:
                    self._slots.release()
                    raise
                wake.clear()  # hints from here on are kept for the idle wait below
                # More free slots, without waiting for any: a burst of turns is claimed a few
                # per statement (a claim's fixed cost, several index probes and its commit, is
                # shared), an idle trickle one at a time as before.
                held = 1
                while held < self._settings.claim_batch and not self._slots.locked():
                    await self._slots.acquire()  # free: returns at once
                    held += 1
                self._owed.claim_sent()  # sent after every ending owed so far committed
                try:
                    claims = await self._claim(held)
                except DB_ERRORS as exc:
                    self._release(held)
                    if lost_race(exc):  # claim_runs had already run it again at once
                        log.warning("claim lost a race with other transactions again after a "
                                    "retry, nothing was claimed; waiting a tick",
                                    extra={"error": str(exc)})
                    else:
                        log.warning("claim failed; waiting a tick", extra={"error": str(exc)})
                    if self._owed.claim_failed():
                        self._hand_on_soon("claim failed")
                    await wake.wait(self._settings.tick_s)
                    continue
                # Wakes it could not act for (it took a turn per slot) stay owed.
                self._owed.claim_done(len(claims), held)
                self._metrics.claim_batch.observe(len(claims))
                self._release(held - len(claims))
                if not claims:
                    await wake.wait(self._settings.tick_s)

    async def _park(self, why: str, parks: bool, waiting: Awaitable[object]) -> None:
        """Await `waiting` (which returns at once unless `parks`), handing on owed wakes while
        parked."""
        if parks:
            self._waiting_for = why
            if self._owed.owed:
                self._hand_on_soon(why)
        try:
            await waiting
        finally:
            self._waiting_for = None

    async def _claim(self, held: int) -> list[Claim]:
        """Claim up to `held` runs and give each its task; nothing once the drain has begun."""
        async with self._claiming:
            if self._draining:
                return []
            claims = await claim_runs(
                self._pool, worker_id=self._worker_id, lease_ttl_s=self._settings.lease_ttl_s,
                limit=held, default_max_running=self._settings.account_max_running,
                hint=self._hint)
            self._start(claims)
            return claims

    def _start(self, claims: Sequence[Claim]) -> None:
        """Give each claimed run its task (which owns the slot taken for it)."""
        for claim in claims:
            self.claimed += 1
            self._metrics.claimed.inc()
            if claim.created_at is not None and claim.started_at is not None:
                self._metrics.enqueue_to_start.observe(
                    (claim.started_at - claim.created_at).total_seconds())
            task = asyncio.create_task(self._run_and_release(claim), name=f"run-{claim.run_id}")
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)

    def _release(self, slots: int) -> None:
        for _ in range(slots):
            self._slots.release()

    async def _run_and_release(self, claim: Claim) -> None:
        finalized = False
        ended = failure(RunErrorCode.INTERNAL_ERROR)
        error: BaseException | None = None
        try:
            finalized = await self._run_turn(claim)
        except asyncio.CancelledError:
            if self._draining:
                ended = DRAIN_FAILURE
        except Exception as exc:
            error = exc
        finally:
            try:
                if not finalized:
                    await asyncio.shield(self._backstop(claim, ended, error))
            finally:
                self._slots.release()

    async def _backstop(self, claim: Claim, ended: RunFailure,
                        error: BaseException | None) -> None:
        """Finalize failed behind the fence; zero rows means someone already ended it."""
        for _attempt in range(3):
            try:
                await finish_run(self._pool, claim, RunStatus.FAILED, seq=None,
                                 error=ended.message, error_code=ended.code, hint=self._hint)
                log_failure(claim.run_id, ended, error, finalized_by="the backstop")
                return
            except SeqConflict:
                continue  # an append landed between our snapshot and our lock: re-read
            except LeaseLost:
                # Ended already, maybe by the turn's own terminal write whose answer went
                # unseen (a drain's cancel, a lost answer): its wakes may not have gone out,
                # and the conversation's next turn would wait for a poll.
                with contextlib.suppress(*DB_ERRORS):
                    await ended_after_lost_answer(self._pool, claim, self._hint)
                return
            except DB_ERRORS as exc:
                log.warning("backstop could not finalize; the reaper will",
                            extra={"run_id": str(claim.run_id), "error": str(exc)})
                return


class Reservation:
    """One slot, taken by Dispatcher.reserve for a claim beside an enqueue, made by the
    enqueue's own statement (queue.post_turn) on the dispatcher's `terms`; `settle` is called
    once whatever happened to it, with the claims that committed (none if nothing did)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher
        self._settled = False
        settings = dispatcher._settings
        self.terms = ClaimBeside(dispatcher._worker_id, settings.lease_ttl_s,
                                 settings.account_max_running)

    def settle(self, committed: Sequence[Claim]) -> None:
        """Start what committed, and give the slot back if nothing did.

        No hint announces the runs' run_started, as the claim loop's claims do (claim_hints):
        it committed with the run itself and with the conversation's wake, so every reader
        finds it in its first read of the run. A run tail opens only once the post has
        answered; a conversation feed, here or in another process, learns of the run from that
        wake. The hint's NOTIFY would cost a transaction, and its commit a WAL flush, on the
        path to the turn's first token."""
        if self._settled:
            return
        self._settled = True
        d = self._dispatcher
        d._metrics.claim_batch.observe(len(committed))
        d._start(committed)
        d._release(1 - len(committed))
        d._beside = None
        d._beside_settled.set()
