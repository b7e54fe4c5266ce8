"""The per-process limiters on their own clock: guessing rates and stream slots."""

from __future__ import annotations

import socket
import uuid

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agentd.api import sse
from agentd.limits import (
    AT_THE_ADDRESS_CAP,
    AT_THE_CAP,
    MAX_TRACKED_ADDRESSES,
    AddressRateLimiter,
    ConnectionGuard,
    StreamSlots,
    Throttled,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_address_gets_its_burst_then_one_attempt_per_refill() -> None:
    clock = Clock()
    limiter = AddressRateLimiter(6, clock=clock)  # 6 a minute: one every 10 s
    assert [limiter.take("198.51.100.7") for _ in range(6)] == [None] * 6
    wait = limiter.take("198.51.100.7")
    assert wait is not None and 9.9 <= wait <= 10.0
    assert limiter.take("203.0.113.9") is None  # another address has its own bucket
    clock.now += 5
    assert limiter.take("198.51.100.7") is not None  # refused attempts do not buy time
    clock.now += 10
    assert limiter.take("198.51.100.7") is None
    assert limiter.take("198.51.100.7") is not None
    clock.now += 3600
    assert [limiter.take("198.51.100.7") for _ in range(7)].count(None) == 6  # burst capped


def test_an_attempt_given_back_is_spent_again_but_never_past_a_full_bucket() -> None:
    limiter = AddressRateLimiter(2, clock=Clock())
    assert [limiter.take("198.51.100.7") for _ in range(2)] == [None, None]
    limiter.give_back("198.51.100.7")
    assert limiter.take("198.51.100.7") is None
    assert limiter.take("198.51.100.7") is not None
    limiter.give_back("203.0.113.9")  # never seen: nothing to give back, no bucket made
    assert "203.0.113.9" not in limiter._buckets
    fresh = AddressRateLimiter(2, clock=Clock())
    assert fresh.take("198.51.100.7") is None
    for _ in range(3):
        fresh.give_back("198.51.100.7")
    assert [fresh.take("198.51.100.7") for _ in range(3)] == [None, None, pytest.approx(30)]


def test_memory_stays_bounded_under_many_addresses() -> None:
    limiter = AddressRateLimiter(5, clock=Clock())
    for n in range(MAX_TRACKED_ADDRESSES + 500):
        limiter.take(f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}")
    assert len(limiter._buckets) == MAX_TRACKED_ADDRESSES


def test_stream_slots_per_device() -> None:
    slots = StreamSlots(2)
    phone, laptop = uuid.uuid4(), uuid.uuid4()
    slots.acquire(phone)
    slots.acquire(phone)
    with pytest.raises(Throttled) as caught:
        slots.acquire(phone)
    assert caught.value.code == "too_many_streams" and caught.value.retry_after_s >= 1
    slots.acquire(laptop)
    assert slots.total == 3
    slots.release(phone)
    slots.acquire(phone)
    for _ in range(3):
        slots.release(phone)  # an extra release never goes negative
    slots.release(laptop)
    assert slots.total == 0


def test_an_ipv6_host_gets_one_bucket_for_its_whole_64() -> None:
    """A host with a /64 can send from any of its addresses: they share one bucket, so it
    cannot buy a fresh set of attempts per address. Another /64, and IPv4, are their own."""
    limiter = AddressRateLimiter(2, clock=Clock())
    assert [limiter.take(f"2001:db8:1:2::{n:x}") for n in range(1, 4)] == [None, None,
                                                                             pytest.approx(30)]
    assert limiter.take("2001:db8:1:3::1") is None
    assert limiter.take("::ffff:198.51.100.7") is None and limiter.take("198.51.100.7") is None
    assert limiter.take("198.51.100.7") is not None  # mapped or not, the same IPv4 address


def test_an_attempt_given_back_can_be_spent_again_but_never_past_a_full_bucket() -> None:
    """Bearer tokens spend before their lookup and give back what named a device."""
    clock = Clock()
    limiter = AddressRateLimiter(2, clock=clock)
    assert limiter.take("198.51.100.7") is None and limiter.take("198.51.100.7") is None
    wait = limiter.take("198.51.100.7")
    assert wait is not None and 29.9 <= wait <= 30.0
    limiter.give_back("198.51.100.7")
    assert limiter.take("198.51.100.7") is None
    for _ in range(5):
        limiter.give_back("198.51.100.7")
    assert [limiter.take("198.51.100.7") is None for _ in range(3)] == [True, True, False]


def test_an_address_holds_its_share_of_connections_and_loopback_is_not_capped() -> None:
    guard = ConnectionGuard(max_connections=16, header_timeout_s=10, per_address=2)
    taken = [guard.admit(("2001:db8::1", 40000, 0, 0)), guard.admit(("2001:db8::2", 40001, 0, 0))]
    assert [why for _, why in taken] == [None, None]
    # The same /64 from a third address: over its share, not over the cap.
    assert guard.admit(("2001:db8::3", 40002, 0, 0)) == (None, AT_THE_ADDRESS_CAP)
    assert guard.admit(("2001:db8:0:1::1", 40003, 0, 0))[1] is None  # another /64
    assert guard.admit(("192.0.2.7", 40004))[1] is None
    for loopback in (("127.0.0.1", 1), ("127.9.9.9", 2), ("::1", 3, 0, 0),
                     ("::ffff:127.0.0.1", 4, 0, 0)):
        for _ in range(3):
            assert guard.admit(loopback)[1] is None
    assert (guard.open, guard.refused, guard.refused_per_address) == (16, 1, 1)
    assert guard.admit(("198.51.100.1", 5)) == (None, AT_THE_CAP)  # the cap holds for all
    key, _ = taken[0]
    guard.leave(key)
    assert guard.admit(("2001:db8::3", 40005, 0, 0))[1] is None  # its share has room again


async def test_a_stream_is_dropped_once_its_client_acknowledges_nothing() -> None:
    """An event stream's socket (a real aiohttp server here) gets TCP_USER_TIMEOUT: a client
    gone without a reset is dropped within it, not after the kernel's ~15 minutes. A plain
    answer's is left alone: a download a client pauses reading is not cut."""
    if not hasattr(socket, "TCP_USER_TIMEOUT"):
        pytest.skip("TCP_USER_TIMEOUT is Linux's")
    seen: dict[str, int] = {}

    def user_timeout(request: web.Request) -> int:
        assert request.transport is not None
        sock = request.transport.get_extra_info("socket")
        return int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))

    async def stream(request: web.Request) -> web.StreamResponse:
        response = await sse.open_stream(request, dead_after_s=40)
        seen["stream"] = user_timeout(request)
        return response

    async def plain(request: web.Request) -> web.Response:
        seen["plain"] = user_timeout(request)
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/stream", stream)
    app.router.add_get("/plain", plain)
    async with TestServer(app) as server, httpx.AsyncClient(base_url=str(server.make_url(
            "/"))) as client:
        assert (await client.get("/plain")).status_code == 200
        async with client.stream("GET", "/stream") as answer:
            assert answer.status_code == 200
    assert seen == {"plain": 0, "stream": 40_000}
