"""The hub: one dedicated LISTEN connection per process, fanned out to in-process subscribers.

Signals are hints; rows are truth (docs/architecture.md). Subscriber queues are bounded and drop on
overflow, and after a reconnect every subscriber is woken, because notifications sent while the
connection was down are gone: consumers re-read rows on every wake, and poll on their own clock
meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import asyncpg

from agentd.db import ping
from agentd.vocabulary import Channel

log = logging.getLogger("agentd.hub")

RECONNECTED = "*reconnected*"  # payload delivered to every subscriber after a reconnect
# A local hint's own NOTIFY comes back within milliseconds; one that has not after this long was
# lost (its statement failed), and the next one like it is another process's news.
ECHO_WINDOW_S = 2.0
MAX_ECHOES = 10_000  # beyond this many awaited echoes, local hints just wake twice
DEAF_MESSAGE = ("the LISTEN connection receives no notifications (is hub_dsn behind a "
                "transaction pooler? it must reach PostgreSQL directly): working at the poll "
                "interval")


class Subscription:
    """A bounded inbox of wake hints for one or more (channel, key) pairs, read by one task.

    Hand-rolled rather than an asyncio.Queue read through wait_for: a streaming tail waits
    after every read, and wait_for wraps each wait in a task of its own (the loop's bookkeeping
    was a tenth of a daemon serving 600 streams); here a wait costs one future and one timer.
    """

    def __init__(self, hub: Hub, size: int) -> None:
        self._hub = hub
        self._size = size
        self._items: deque[str] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # Whether a hint came since the last clear() whose rows are not at hand: from another
        # process, a reconnect, or a local write that did not hand its rows over (journaled).
        self._stale = True
        self.keys: set[tuple[Channel, str | None]] = set()
        self.dropped = 0

    def listen(self, channel: Channel, key: str | None = None) -> None:
        """Also receive hints for `channel` (payload == key, or every payload if key is None)."""
        if (channel, key) not in self.keys:
            self.keys.add((channel, key))
            self._hub._register(self, channel, key)

    def unlisten(self, channel: Channel, key: str | None = None) -> None:
        if (channel, key) in self.keys:
            self.keys.discard((channel, key))
            self._hub._unregister(self, channel, key)

    def deliver(self, payload: str, *, rows_at_hand: bool = False) -> None:
        """A hint; `rows_at_hand`: the rows it announces were handed to this process's shared
        reads before it (a local journal batch), so reading them back is not needed."""
        if not rows_at_hand:
            self._stale = True
        if len(self._items) < self._size:
            self._items.append(payload)
        else:
            # A full inbox already means "something changed"; the consumer re-reads rows.
            self.dropped += 1
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, poll_s: float, *,
                   until: asyncio.Future[Any] | None = None) -> set[str]:
        """Wait for hints; returns their payloads (empty when the poll interval passed first,
        or when `until`, some other work of the reader's, finished first)."""
        if not self._items and (until is None or not until.done()):
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(poll_s, _time_is_up, waiter)

            def done(_: asyncio.Future[Any]) -> None:
                _time_is_up(waiter)

            if until is not None:
                until.add_done_callback(done)
            try:
                await waiter
            finally:
                timer.cancel()
                if until is not None:
                    until.remove_done_callback(done)
                self._waiter = None
        return self.drain()

    def drain(self) -> set[str]:
        """Take every pending hint without waiting."""
        payloads = set(self._items)
        self._items.clear()
        return payloads

    def clear(self) -> bool:
        """Forget pending hints (call before re-reading rows, so later hints are kept); returns
        whether any hint since the last clear announced rows that are not at hand (then read
        them from the database)."""
        self._items.clear()
        stale, self._stale = self._stale, False
        return stale

    def pending(self) -> bool:
        return bool(self._items)

    @property
    def waiting(self) -> bool:
        """Whether its reader is waiting for a hint right now (idle, nothing pending)."""
        return self._waiter is not None and not self._waiter.done()


def _time_is_up(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Hub:
    """Owns the LISTEN connection; a single supervisor task connects, listens and reconnects."""

    def __init__(self, dsn: str, *, channels: Iterable[Channel] = tuple(Channel),
                 queue_size: int = 64, probe_interval_s: float = 5.0,
                 max_backoff_s: float = 5.0,
                 send_probe: Callable[[str], Awaitable[None]] | None = None,
                 hear_within_s: float = 3.0) -> None:
        """`send_probe(token)` sends NOTIFY agentd_hub_probe from another connection: after each
        connect the hub checks that it comes back within `hear_within_s` (a LISTEN behind a
        transaction pooler connects and listens fine, then never hears anything)."""
        self._dsn = dsn
        self._channels = tuple(channels)
        self._queue_size = queue_size
        self._probe_interval_s = probe_interval_s
        self._max_backoff_s = max_backoff_s
        self._subscribers: dict[tuple[Channel, str | None], set[Subscription]] = \
            defaultdict(set)
        self._conn: asyncpg.Connection | None = None
        self._connected = asyncio.Event()
        self._lost = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None
        self._send_probe = send_probe
        self._hear_within_s = hear_within_s
        self._probe_token: str | None = None
        self._probe_heard = asyncio.Event()
        self.deaf = False  # connected and listening, yet its own probe never came back
        self.reconnects = 0
        self.notifications = 0
        self.echoes = 0  # notifications dropped: their hint was delivered here already
        self._echoes: dict[tuple[Channel, str], list[float]] = {}

    @property
    def connected(self) -> bool:
        """Notifications arrive: wake on hints (else consumers poll at their short interval)."""
        return self._connected.is_set() and not self.deaf

    @property
    def listening(self) -> bool:
        """The LISTEN connection is up (whether or not notifications reach it)."""
        return self._connected.is_set()

    @property
    def backend_pid(self) -> int | None:
        conn = self._conn
        return conn.get_server_pid() if conn is not None and not conn.is_closed() else None

    async def start(self, *, wait_s: float = 5.0) -> None:
        """Start the supervisor; waits briefly for the first connection but never fails on it."""
        self._supervisor = asyncio.create_task(self._supervise(), name="agentd-hub")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout=wait_s)

    async def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        await self._disconnect()

    @contextlib.asynccontextmanager
    async def watch(self) -> AsyncIterator[Subscription]:
        """An inbox to `listen` on any number of (channel, key) pairs; all dropped on exit."""
        sub = Subscription(self, self._queue_size)
        try:
            yield sub
        finally:
            for channel, key in list(sub.keys):
                sub.unlisten(channel, key)

    @contextlib.asynccontextmanager
    async def subscribe(self, channel: Channel,
                        key: str | None = None) -> AsyncIterator[Subscription]:
        """Receive hints for `channel` (payload == key, or all payloads when key is None)."""
        async with self.watch() as sub:
            sub.listen(channel, key)
            yield sub

    def _register(self, sub: Subscription, channel: Channel, key: str | None) -> None:
        self._subscribers[(channel, key)].add(sub)

    def _unregister(self, sub: Subscription, channel: Channel, key: str | None) -> None:
        subs = self._subscribers.get((channel, key))
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subscribers[(channel, key)]

    def subscriber_count(self) -> int:
        return sum(len(s) for s in self._subscribers.values())

    def subscribers(self, channel: Channel, key: str | None = None) -> list[Subscription]:
        """The inboxes listening for exactly (channel, key)."""
        return list(self._subscribers.get((channel, key), ()))

    def hint_locally(self, channel: Channel, payload: str, *, echo: bool,
                     rows_at_hand: bool = False) -> None:
        """Wake this process's subscribers now, for rows this process has just committed,
        instead of after the round trip through PostgreSQL (the NOTIFY still goes out, for the
        fleet). `echo`: that NOTIFY is sent after this call, so when it comes back here it is
        dropped (these subscribers were woken for it already); hints whose NOTIFY may already
        be on its way (sent inside the committing transaction) pass echo=False: they wake their
        subscribers twice, unless the echo was awaited before the statement (expect_echo)."""
        if echo:
            self._await_echo(channel, payload)
        self._route(channel, payload, rows_at_hand=rows_at_hand)

    def expect_echo(self, channel: Channel, payload: str) -> Callable[[], None]:
        """Before a statement whose transaction sends this NOTIFY: drop its echo when it comes
        back, since the sender wakes this process's subscribers itself (hint_locally, echo=False)
        once it has committed. Awaited before the statement, not after, because the echo can
        arrive before the statement's own answer is read. Returns `forget`, for a statement
        that did not commit (no echo will come: another process's news must not be dropped)."""
        due = self._await_echo(channel, payload)

        def forget() -> None:
            expected = self._echoes.get((channel, payload))
            if due is not None and expected and due in expected:
                expected.remove(due)
                if not expected:
                    del self._echoes[(channel, payload)]

        return forget

    def _await_echo(self, channel: Channel, payload: str) -> float | None:
        if not self.connected:  # its NOTIFY will not come back here at all
            return None
        if len(self._echoes) >= MAX_ECHOES:
            self._forget_expired_echoes()
        if len(self._echoes) >= MAX_ECHOES:
            return None
        due = time.monotonic() + ECHO_WINDOW_S
        self._echoes.setdefault((channel, payload), []).append(due)
        return due

    def _forget_expired_echoes(self) -> None:
        now = time.monotonic()
        for key in [k for k, due in self._echoes.items() if not due or due[-1] < now]:
            del self._echoes[key]

    def _route(self, channel: Channel, payload: str, *, rows_at_hand: bool = False) -> None:
        for sub in self._subscribers.get((channel, payload), ()):
            sub.deliver(payload, rows_at_hand=rows_at_hand)
        for sub in self._subscribers.get((channel, None), ()):
            sub.deliver(payload, rows_at_hand=rows_at_hand)

    def _is_echo(self, channel: Channel, payload: str) -> bool:
        """Whether this notification is one this process announced locally already. Expected
        echoes expire: a NOTIFY that was lost (its statement failed) must not swallow a later
        one of another process for long."""
        expected = self._echoes.get((channel, payload))
        if not expected:
            return False
        now = time.monotonic()
        while expected and expected[0] < now:
            expected.pop(0)
        if not expected:
            del self._echoes[(channel, payload)]
            return False
        expected.pop(0)
        if not expected:
            del self._echoes[(channel, payload)]
        return True

    def _on_notify(self, _conn: Any, _pid: int, channel: str, message: object) -> None:
        # Runs on the event loop inside asyncpg's protocol: only hand off, never do work here.
        self.notifications += 1
        payload = str(message)  # a NOTIFY payload is text
        try:
            chan = Channel(channel)
        except ValueError:
            return
        if chan is Channel.HUB_PROBE:
            if payload == self._probe_token:
                self._probe_heard.set()
            return
        if self._is_echo(chan, payload):
            self.echoes += 1
            return
        self._route(chan, payload)

    def _on_terminate(self, _conn: Any) -> None:
        self._lost.set()

    def _wake_everyone(self) -> None:
        # What was sent while we were not listening never comes back: await no echo of it.
        self._echoes.clear()
        for subs in list(self._subscribers.values()):
            for sub in list(subs):
                sub.deliver(RECONNECTED)

    async def _connect(self) -> None:
        conn = await asyncpg.connect(self._dsn, server_settings={"application_name":
                                                                 "agentd-hub"})
        conn.add_termination_listener(self._on_terminate)
        for channel in self._channels:
            await conn.add_listener(channel.value, self._on_notify)
        self._conn = conn
        self._lost.clear()
        self._connected.set()

    async def _disconnect(self) -> None:
        self._connected.clear()
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), timeout=1.0)
            if not conn.is_closed():
                conn.terminate()

    async def _supervise(self) -> None:
        backoff = 0.05
        first = True
        while True:
            try:
                await self._connect()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError,
                    TimeoutError) as exc:
                log.warning("hub connect failed; retrying", extra={"error": str(exc),
                                                                    "retry_s": backoff})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)
                continue
            backoff = 0.05
            if not first:
                self.reconnects += 1
                log.info("hub reconnected", extra={"reconnects": self.reconnects})
                self._wake_everyone()
            first = False
            await self._check_hearing()
            await self._watch()
            log.warning("hub connection lost; falling back to polling until it returns")
            await self._disconnect()

    async def _check_hearing(self) -> None:
        """Send our own probe NOTIFY from another connection; deaf if it does not come back."""
        if self._send_probe is None:
            return
        token = secrets.token_hex(8)
        self._probe_token = token
        self._probe_heard.clear()
        try:
            await self._send_probe(token)
            await asyncio.wait_for(self._probe_heard.wait(), timeout=self._hear_within_s)
        except TimeoutError:
            if not self.deaf:
                log.error(DEAF_MESSAGE, extra={"waited_s": self._hear_within_s})
            self.deaf = True
            return
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            log.warning("could not send the hub's probe; will retry", extra={"error": str(exc)})
            return
        if self.deaf:
            log.info("the LISTEN connection hears notifications again")
            self._wake_everyone()
        self.deaf = False

    async def _watch(self) -> None:
        """Return when the connection is gone (terminated, or failing a liveness probe)."""
        while True:
            try:
                await asyncio.wait_for(self._lost.wait(), timeout=self._probe_interval_s)
                return
            except TimeoutError:
                pass
            if self.deaf:  # until it hears again (someone fixed the pooler's mode)
                await self._check_hearing()
            conn = self._conn
            if conn is None or conn.is_closed():
                return
            try:
                await asyncio.wait_for(ping(conn), timeout=2.0)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
                return
