"""Wake hints sent after commit, batched, outside the transactions that caused them.

PostgreSQL serializes every committing transaction that carries a NOTIFY on one cluster-wide lock
held until its commit is flushed; a hint per journal append made concurrent turns commit one at a
time. Hints are hints, rows are truth (docs/architecture.md): sending them just after the commit,
from one statement per batch, loses nothing a poll would not recover, and frees the hot commits to
flush together.

A dispatchers' wake (run_enqueued) from a turn's ending is decided by the sending statement after
the commit that caused it (queue.notify_batch): only while the ending's account has a turn queued,
or every claim loop would claim nothing. While this process's claim loop will claim (`claim_loop`:
not draining, not holding back under overload), the wake goes to that loop alone and no NOTIFY is
sent. An ending frees at most one queued turn, the one its conversation or its account's running
limit held back (several only after that limit was lowered), and the process that ran it has just
given that turn's slot back: its own claim, made after the ending committed, can take the turn. Any
other queued turn was claimable before (its enqueue woke every loop then), or was freed by a raised
limit (whose statement wakes every loop). Waking the fleet for it made every other process run a
claim that found nothing (docs/benchmarks.md, "Fifteenth look"). The loop is told that it owes the
wake (`ClaimLoop.owe_wake`): if it cannot act on it (a post took the slot meanwhile, overload
began, its claim failed), it hands the wake on to the fleet, at once if it is parked on a slot or
on the load when the wake comes (dispatcher.py).
A process that will not claim sends the wake to the fleet, and its own loop hears it once the
statement says it went out; a drain tells the fleet once its loop is parked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

import asyncpg

from agentd.queue import notify_batch
from agentd.vocabulary import Channel

log = logging.getLogger("agentd.notifier")


class LocalHub(Protocol):
    """What the notifier needs of the process's hub (hub.Hub)."""

    def hint_locally(self, channel: Channel, payload: str, *, echo: bool,
                     rows_at_hand: bool = False) -> None: ...

    def expect_echo(self, channel: Channel, payload: str) -> Callable[[], None]: ...


class ClaimLoop(Protocol):
    """What the notifier needs of the process's claim loop (dispatcher.Dispatcher)."""

    def claims(self) -> bool:
        """Whether it will claim now (an ending's wake may then go to it alone)."""
        ...

    def owe_wake(self, committed_by: float, wakes: int) -> None:
        """The wakes of `wakes` endings committed by `committed_by` (time.monotonic()) went
        to it alone: it claims after them, or hands them on to the fleet."""
        ...


class Notifier:
    """Collects (channel, payload) hints and sends each batch in one statement, in order; with
    `local` (the process's hub), this process's own subscribers are woken at once (its claim
    loop once the statement has decided that its wake goes out)."""

    def __init__(self, pool: asyncpg.Pool, local: LocalHub | None = None, *,
                 claim_loop: Callable[[], ClaimLoop | None] | None = None) -> None:
        """`claim_loop`: this process's claim loop (None while it has none yet); while it
        claims, the dispatchers' wakes of endings go to it alone (its owe_wake, and its hub
        subscription through `local`). None: a process without a claim loop of its own, whose
        wakes go to the fleet."""
        self._pool = pool
        self._local = local
        self._claim_loop = claim_loop
        # Ordered, de-duplicated; for each, how to stop awaiting the echo of its NOTIFY should
        # the batch fail (None: no echo awaited).
        self._pending: dict[tuple[Channel, str], Callable[[], None] | None] = {}
        self._wakes_by: float | None = None  # when the newest pending dispatchers' wake came
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._send_forever(), name="agentd-notifier")

    async def close(self) -> None:
        """Send what is pending, then stop."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._flush()

    def notify(self, channel: Channel, payload: str, *, rows_at_hand: bool = False) -> None:
        """A hint for rows already committed: this process hears it now, every time (a
        subscriber may have read between two commits), the fleet once the batch is sent —
        which carries each (channel, payload) once, so the hub awaits one echo per batch. A
        dispatchers' wake is the exception: heard here, too, only once the batch has sent it.
        `rows_at_hand`: the rows were handed to this process's shared reads already."""
        hint = (channel, payload)
        first = hint not in self._pending
        if first:
            self._pending[hint] = None
        if self._local is not None and channel is not Channel.RUN_ENQUEUED:
            if first:
                self._pending[hint] = self._local.expect_echo(channel, payload)
            self._local.hint_locally(channel, payload, echo=False, rows_at_hand=rows_at_hand)
        if channel is Channel.RUN_ENQUEUED:
            self._wakes_by = time.monotonic()  # its rows committed before this call
        self._wake.set()

    def notify_rows_at_hand(self, channel: Channel, payload: str) -> None:
        """notify, for a journal batch whose rows this process's tails already hold."""
        self.notify(channel, payload, rows_at_hand=True)

    async def _send_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._flush()

    async def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        batch = list(pending)
        committed_by, self._wakes_by = self._wakes_by, None
        loop = self._claim_loop() if self._claim_loop is not None else None
        fleet = loop is None or not loop.claims()
        wakes = [hint for hint in batch if hint[0] is Channel.RUN_ENQUEUED]
        # The fleet's wakes, whose NOTIFY may come back before the statement's answer: their
        # echoes are awaited first, then dropped or forgotten (hub.expect_echo).
        echoes = {hint: self._local.expect_echo(*hint) for hint in wakes} \
            if self._local is not None and fleet else {}
        failed = False
        try:
            sent = set(await notify_batch(self._pool, batch, fleet_wakes=fleet))
        except asyncio.CancelledError:
            # Whatever went out, no echo is awaited any more (one that comes wakes twice).
            for forget in [*echoes.values(), *filter(None, pending.values())]:
                forget()
            raise
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            # Lost hints cost latency, never correctness: every waiter also polls. Nothing
            # went out; this process's claim loop is woken all the same.
            log.warning("could not send wake hints", extra={"hints": len(batch),
                                                            "error": str(exc)})
            sent, failed = set(), True
            # No NOTIFY of ours will come: another process's must not be dropped in its place.
            for forget in filter(None, pending.values()):
                forget()
        for hint, forget in echoes.items():
            if hint not in sent:
                forget()  # no NOTIFY of ours will come: another process's must get through
        owed = [hint for hint in wakes if hint in sent or failed]
        if owed and committed_by is not None and loop is not None and not fleet:
            loop.owe_wake(committed_by, len(owed))  # before the hint that wakes it
        if self._local is not None:
            for hint in owed:
                self._local.hint_locally(*hint, echo=False)
