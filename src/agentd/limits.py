"""Limits an exposed daemon needs: connections, slow clients, streams per device, guess rates.

All of them are per process (a fleet of N processes admits N times as much; docs/operations.md
says so). The connection guard sits between asyncio and aiohttp's protocol because aiohttp
counts no connections and times no request heads: its keep-alive timer is the only clock it
runs before a request, and that one only notices a head that never completes after
`idle_timeout_s` — a client trickling one byte a second would hold a connection for that long.

Over TLS the guard is outside the TLS layer: it counts a connection from the moment it is
accepted and does the handshake itself (loop.start_tls). asyncio's own TLS server tells the
protocol of a connection only once its handshake is done, so connections still in (or stalled
in) their handshake went uncounted, and anyone could hold as many as the open-files limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import logging
import math
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, cast
from uuid import UUID

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("agentd.limits")

MAX_TRACKED_ADDRESSES = 10_000
# Requests whose bearer token names no one, per client address and minute: past it an address is
# refused before its token is looked up (each lookup is a database read).
AUTH_FAILURES_PER_MIN = 300
# How long a token that named a device is let through an address refused for guessing.
VALID_TOKEN_MEMORY_S = 600.0
STREAM_RETRY_AFTER_S = 5


class Throttled(Exception):
    """Over a limit: answered 429 with a stable code and Retry-After (whole seconds)."""

    def __init__(self, code: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = max(1, math.ceil(retry_after_s))


def rate_key(address: str) -> str:
    """Whose attempts `address`'s are: an IPv6 host is given a whole /64 (it can send from any
    address in it, each of which would otherwise start with a full bucket); an IPv4 address,
    mapped into IPv6 or not, is itself."""
    try:
        parsed = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address  # not an IP address (a unix socket): as given
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed)


def loopback_address(address: str) -> bool:
    """Whether a peer's address is this machine's loopback (an IPv4 client of a dual-stack
    socket included); a unix socket or no address at all is not a TCP client of this machine."""
    try:
        parsed = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return parsed.ipv4_mapped.is_loopback
    return parsed.is_loopback


class AddressRateLimiter:
    """A token bucket per client address: `per_minute` attempts, refilled continuously.

    Memory is bounded: past MAX_TRACKED_ADDRESSES the least recently seen address is forgotten
    (it starts again with a full bucket, which a spread-out attacker gains nothing from: the
    codes it guesses at still expire in minutes).
    """

    def __init__(self, per_minute: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, address: str) -> float | None:
        """Spend one attempt: None if allowed, else the seconds until the next one is."""
        address = rate_key(address)
        now = self._clock()
        tokens, stamp = self._buckets.pop(address, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - stamp) * self.rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        self._buckets[address] = (tokens, now)
        while len(self._buckets) > MAX_TRACKED_ADDRESSES:
            self._buckets.popitem(last=False)
        return None if allowed else (1.0 - tokens) / self.rate

    def give_back(self, address: str) -> None:
        """Return an attempt `take` spent (never past a full bucket): for an attempt the
        database never judged, such as a statement that lost a race and rolled back, or one
        that proved not to be a failure (a token that names a device)."""
        address = rate_key(address)
        if address in self._buckets:
            tokens, stamp = self._buckets[address]
            self._buckets[address] = (min(self.capacity, tokens + 1.0), stamp)


class RecentlyValid:
    """Hashes of the tokens that named a device in this process within the last `memory_s`
    (at most MAX_TRACKED_ADDRESSES of them, the oldest forgotten first).

    An address refused for guessing tokens is refused before the lookup, and so would be every
    device behind it: a reverse proxy or a NAT gives them all one address. A token seen valid
    lately is still looked up; only tokens not known to work wait out the guesser's penalty.
    """

    def __init__(self, memory_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.memory_s = memory_s
        self._clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def add(self, digest: bytes) -> None:
        self._seen.pop(digest, None)
        self._seen[digest] = self._clock()
        while len(self._seen) > MAX_TRACKED_ADDRESSES:
            self._seen.popitem(last=False)

    def discard(self, digest: bytes) -> None:
        self._seen.pop(digest, None)

    def __contains__(self, digest: object) -> bool:
        seen = self._seen.get(digest) if isinstance(digest, bytes) else None
        return seen is not None and self._clock() - seen <= self.memory_s


class StreamSlots:
    """At most `per_device` open SSE streams per device in this process."""

    def __init__(self, per_device: int) -> None:
        self.per_device = per_device
        self._open: dict[UUID, int] = {}

    @property
    def total(self) -> int:
        return sum(self._open.values())

    def acquire(self, device_id: UUID) -> None:
        held = self._open.get(device_id, 0)
        if held >= self.per_device:
            raise Throttled("too_many_streams", f"this device already holds {held} open "
                            "streams on this server; close one first", STREAM_RETRY_AFTER_S)
        self._open[device_id] = held + 1

    def release(self, device_id: UUID) -> None:
        left = self._open.get(device_id, 0) - 1
        if left > 0:
            self._open[device_id] = left
        else:
            self._open.pop(device_id, None)


def peer_address(request: web.Request) -> str:
    """The address of the socket's other end (never a forwarded header: those can be forged)."""
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return ""


# -- connections ------------------------------------------------------------------------------


AT_THE_CAP = "the server is at its connection limit; retry"
AT_THE_ADDRESS_CAP = ("this address holds as many connections as the server allows one address; "
                      "close some and retry")


def _refusal(message: str) -> bytes:
    # Written by hand because the connection is never given to aiohttp: that is the point.
    body = json.dumps({"error": {"code": "too_many_connections", "message": message}})
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Retry-After: 1\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body.encode()


# Connections over the cap that still get their TLS handshake, to be told why (a 503) rather than
# see a reset: beyond this many at once they are closed at once.
REFUSALS_OVER_TLS = 16


def drop_when_unacknowledged(sock: socket.socket | None, seconds: float) -> None:
    """TCP_USER_TIMEOUT (Linux): the kernel drops the connection once data it sent has gone
    unacknowledged for `seconds`. Elsewhere, or on a socket that is not TCP, nothing."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is None or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, option, int(seconds * 1000))


class ConnectionGuard:
    """Counts this process's connections and times request heads; see the module docstring.

    One client address (an IPv6 host's whole /64) holds at most `per_address` of them, so that
    one host cannot take every place; loopback is this machine's own and is not capped.
    """

    def __init__(self, *, max_connections: int, header_timeout_s: float,
                 per_address: int | None = None) -> None:
        self.max_connections = max_connections
        self.per_address = per_address or max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.refused = 0
        self.refused_per_address = 0
        # Only addresses with a connection open: bounded by max_connections.
        self._by_address: dict[str, int] = {}
        self.head_timeouts = 0
        self.refusing = 0  # over-cap connections in their TLS handshake, to be answered 503
        self._by_handler: dict[RequestHandler, _GuardedProtocol] = {}

    def protocol_factory(self, make_handler: Callable[[], RequestHandler], *,
                         tls: ssl.SSLContext | None = None,
                         ) -> Callable[[], asyncio.Protocol]:
        """`tls`: the guard does each accepted connection's handshake with it (over the
        header timeout, the connection is closed)."""
        return lambda: _GuardedProtocol(self, make_handler(), tls)

    def admit(self, peer: object) -> tuple[str | None, str | None]:
        """Take a place for a connection from `peer` (a socket's peername): (the key its place
        is counted under, None) or (None, why it is refused)."""
        if self.open >= self.max_connections:
            self.refused += 1
            return None, AT_THE_CAP
        key = _capped_address(peer)
        if key is not None:
            held = self._by_address.get(key, 0)
            if held >= self.per_address:
                self.refused += 1
                self.refused_per_address += 1
                return None, AT_THE_ADDRESS_CAP
            self._by_address[key] = held + 1
        self.open += 1
        return key, None

    def leave(self, key: str | None) -> None:
        """Give back a place `admit` took."""
        self.open -= 1
        if key is not None:
            left = self._by_address.get(key, 0) - 1
            if left > 0:
                self._by_address[key] = left
            else:
                self._by_address.pop(key, None)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                         ) -> web.StreamResponse:
        """Marks the connection busy while a request runs: its head has arrived whole."""
        guarded = self._by_handler.get(request.protocol)
        if guarded is None:
            return await handler(request)
        guarded.request_started()
        try:
            return await handler(request)
        finally:
            guarded.request_finished()


class _GuardedProtocol(asyncio.Protocol):
    """Forwards everything to aiohttp's protocol, after the connection cap and the head timer."""

    def __init__(self, guard: ConnectionGuard, inner: RequestHandler,
                 tls: ssl.SSLContext | None = None) -> None:
        self._guard = guard
        self._inner = inner
        self._tls = tls
        self._transport: asyncio.Transport | None = None
        self._admitted = False  # it holds a place under the cap
        self._address: str | None = None  # and under this address's cap, if one applies
        self._refusing = False  # it holds a place among the refusals over TLS
        self._serving = False  # aiohttp's protocol has the connection
        self._lost = False  # the connection ended before the handshake's task had its answer
        self._busy = False
        self._refusal = AT_THE_CAP  # why it is refused, when it is
        self._timer: asyncio.TimerHandle | None = None
        self._handshake: asyncio.Task[None] | None = None
        # What the TLS layer decrypted before start_tls returned to us (the client's request
        # can follow its handshake at once): handed to aiohttp's protocol once it is served.
        self._early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (an event loop's own need not subclass asyncio.Transport).
        transport = self._transport = cast(asyncio.Transport, transport)
        guard = self._guard
        self._address, refused = guard.admit(transport.get_extra_info("peername"))
        if refused is not None:
            self._refusal = refused
            if self._tls is None:
                transport.write(_refusal(refused))
                transport.close()
            elif guard.refusing < REFUSALS_OVER_TLS:
                guard.refusing += 1
                self._refusing = True
                self._start_tls(transport, admitted=False)
            else:
                transport.abort()
            return
        self._admitted = True
        if self._tls is None:
            self._serve(transport)
        else:
            self._start_tls(transport, admitted=True)

    def _start_tls(self, raw: asyncio.Transport, *, admitted: bool) -> None:
        # Nothing is read until the TLS layer reads it: the client's hello stays in the socket.
        raw.pause_reading()
        self._handshake = asyncio.get_running_loop().create_task(
            self._handshake_then(raw, admitted))
        self._handshake.add_done_callback(functools.partial(self._handshake_ended, raw))

    def _handshake_ended(self, raw: asyncio.Transport, task: asyncio.Task[None]) -> None:
        # A task cancelled before its first step (the loop shutting down) never runs its own
        # cleanup: the place it holds is given back here (once, whoever comes first).
        if task.cancelled():
            raw.abort()
            self._leave()

    async def _handshake_then(self, raw: asyncio.Transport, admitted: bool) -> None:
        assert self._tls is not None
        loop = asyncio.get_running_loop()
        secure: asyncio.BaseTransport | None = None
        # Both bounded: the handshake, and the wait for the client's close_notify once the
        # connection is closed (asyncio's default, 30 s, would keep a closed one that long).
        bound = max(1.0, math.ceil(self._guard.header_timeout_s))
        try:
            secure = await loop.start_tls(raw, self, self._tls, server_side=True,
                                          ssl_handshake_timeout=bound,
                                          ssl_shutdown_timeout=bound)
        except (OSError, ssl.SSLError, TimeoutError, RuntimeError):
            raw.abort()  # failed, stalled or abandoned: it is never served
        finally:
            if secure is None:  # whatever ended the handshake, the place it held is free
                self._leave()
        if secure is None:
            return
        if self._lost:  # it ended as the handshake did: nothing to serve, nothing to answer
            self._leave()
            return
        transport = self._transport = cast(asyncio.Transport, secure)
        if not admitted:
            # Its place among the refusals is given back once it is closed (connection_lost).
            transport.write(_refusal(self._refusal))
            transport.close()
            return
        self._serve(transport)

    def _serve(self, transport: asyncio.Transport) -> None:
        self._serving = True
        self._guard._by_handler[self._inner] = self
        self._inner.connection_made(transport)
        # A new connection's first request head must arrive within the timeout too: one that
        # sends nothing would otherwise hold its place until aiohttp's idle timeout.
        self._start_timer()
        early, self._early = self._early, []
        for data in early:
            self._inner.data_received(data)

    def _start_timer(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._guard.header_timeout_s, self._head_timed_out)

    def _leave(self) -> None:
        """Give back the place this connection holds, under the cap or among the refusals
        (once)."""
        if self._admitted:
            self._admitted = False
            self._guard.leave(self._address)
        if self._refusing:
            self._refusing = False
            self._guard.refusing -= 1

    def data_received(self, data: bytes) -> None:
        if not self._serving:
            if self._admitted and self._handshake is not None:
                self._early.append(data)
            return
        if not self._busy and self._timer is None:
            # The first byte of a request head: all of it must follow within the timeout.
            self._start_timer()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._serving:
            self._inner.eof_received()
        return None  # close the transport (aiohttp's handler answers None too)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._handshake is not None and not self._handshake.done():
            self._lost = True  # the handshake's task gives the place back
            return
        self._leave()
        if not self._serving:
            return
        self._serving = False
        self._guard._by_handler.pop(self._inner, None)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._serving:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._serving:
            self._inner.resume_writing()

    def request_started(self) -> None:
        self._busy = True
        self._cancel_timer()

    def request_finished(self) -> None:
        self._busy = False

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._busy or self._transport is None:
            return
        self._guard.head_timeouts += 1
        log.info("closed a connection whose request head did not arrive in time",
                 extra={"peer": str(self._transport.get_extra_info("peername")),
                        "timeout_s": self._guard.header_timeout_s})
        self._transport.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _capped_address(peer: object) -> str | None:
    """Whose connections `peer`'s count as (rate_key), or None for loopback, which is this
    machine's own (the local TUI, a reverse proxy that reaches the daemon over loopback, a
    benchmark). A proxy in a container on a bridge network is another address."""
    if not (isinstance(peer, tuple) and peer):
        return None
    address = str(peer[0])
    return None if loopback_address(address) else rate_key(address)


class GuardedSite(web.BaseSite):
    """aiohttp's TCPSite, with every connection passed through a ConnectionGuard first."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, *,
                 guard: ConnectionGuard, ssl_context: Any = None, backlog: int = 128,
                 handlers: Callable[[web.Server], Callable[[], RequestHandler]] | None = None,
                 ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        # How each connection's aiohttp protocol is built from the runner's server (None:
        # aiohttp's own); the API answers parser errors in JSON through it.
        self._handlers = handlers
        # Bound before anything else started (agentd.listen), so a busy address touched nothing.
        self._sock = sock
        self._host, self._port = sock.getsockname()[:2]
        self._guard = guard

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{scheme}://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        # TLS is the guard's (start_tls), so a connection counts from its accept: a client
        # that connects and never finishes its handshake is a slow head too.
        self._server = await loop.create_server(
            self._guard.protocol_factory(server if self._handlers is None
                                         else self._handlers(server), tls=self._ssl_context),
            sock=self._sock, backlog=self._backlog)
