"""Limits an exposed daemon needs, over real sockets: streams per device, slow request heads and
bodies, idle keep-alive connections, the connection cap, and what /metrics, /readyz and /healthz
tell a client that is neither local nor authenticated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import ssl
import time

import asyncpg
import httpx
import pytest

from agentd.limits import AUTH_FAILURES_PER_MIN
from agentd.settings import Settings
from tests.process.helpers import wait_status
from tests.remote.helpers import (
    RemoteDaemon,
    SpawnRemote,
    metric,
    non_loopback_address,
    only_this_connection_open,
    socket_closed,
)
from tests.streams.helpers import post_run
from tests.support.daemon import poll_until
from tests.support.factories import (
    create_conversation,
    enqueue_demo,
    new_account,
    new_conversation,
    new_device,
)

HEAD = b"GET /healthz HTTP/1.1\r\nHost: agentd\r\nUser-Agent: slowloris\r\n\r\n"


async def test_a_device_gets_at_most_its_streams_and_another_device_is_unaffected(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    daemon = spawn_remote()
    await daemon.wait_ready()
    per_device = Settings().streams_per_device
    assert per_device == 16
    phone = await new_device(pool, "alice", "phone")
    laptop = await new_device(pool, "alice", "laptop")
    async with phone.client(daemon) as on_phone, laptop.client(daemon) as on_laptop, \
            contextlib.AsyncExitStack() as streams, asyncio.timeout(120):
        conversation = await create_conversation(on_phone)
        turn = await post_run(on_phone, conversation, "streamed", tokens=1000, delay_ms=500)
        feed = f"/v1/conversations/{conversation}/events"
        run_stream = f"/v1/runs/{turn['run_id']}/events"
        opened = []
        for n in range(per_device):  # both kinds of stream count
            path = run_stream if n % 2 else feed
            response = await streams.enter_async_context(on_phone.stream("GET", path))
            assert response.status_code == 200, n
            opened.append(response)

        for path in (feed, run_stream):
            over = await on_phone.get(path)
            assert over.status_code == 429, over.text
            assert over.json()["error"]["code"] == "too_many_streams"
            assert int(over.headers["Retry-After"]) >= 1
        # A wait lasts minutes, as a stream does, and takes a slot as one does; a poll
        # (timeout 0) answers at once and needs none.
        wait = f"/v1/runs/{turn['run_id']}/wait"
        over = await on_phone.get(wait, params={"timeout": 60}, timeout=10)
        assert over.status_code == 429 and over.json()["error"]["code"] == "too_many_streams"
        assert (await on_phone.get(wait, params={"timeout": 0})).status_code == 200
        async with on_laptop.stream("GET", feed) as other:
            assert other.status_code == 200  # the limit is the phone's, not the account's

        await opened[0].aclose()  # hang up one stream: its slot comes back

        async def reopened() -> bool:
            async with on_phone.stream("GET", feed) as again:
                return again.status_code == 200

        await poll_until(reopened, 10, interval=0.1, what="a slot freed by the hang-up")
        await on_phone.post(f"/v1/runs/{turn['run_id']}/cancel")


async def trickle_head(host: str, port: int, *, context: ssl.SSLContext | None = None,
                       within: float) -> tuple[float, int]:
    """Send a request head one byte a second; (seconds until the server hung up, bytes sent)."""
    reader, writer = await asyncio.open_connection(host, port, ssl=context,
                                                   server_hostname=host if context else None)
    sent = 0
    started = time.monotonic()

    async def send_slowly() -> None:
        nonlocal sent
        with contextlib.suppress(ConnectionError, OSError):
            for byte in HEAD:
                writer.write(bytes([byte]))
                await writer.drain()
                sent += 1
                await asyncio.sleep(1.0)  # the client's pace, not a wait for a state

    sender = asyncio.create_task(send_slowly())
    try:
        received = await socket_closed(reader, within)
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        writer.close()
    assert received == b"", f"the server answered a head it never got whole: {received!r}"
    return time.monotonic() - started, sent


async def test_a_head_trickled_byte_by_byte_is_cut_off_within_the_timeout(
        spawn_remote: SpawnRemote) -> None:
    daemon = spawn_remote()  # the default header_timeout_s
    await daemon.wait_ready()
    timeout = Settings().header_timeout_s
    assert timeout == 10.0
    elapsed, sent = await trickle_head("127.0.0.1", daemon.port, within=timeout + 5)
    assert timeout - 1.5 <= elapsed <= timeout + 2, elapsed
    assert sent < len(HEAD)
    assert "did not arrive in time" in daemon.log_text()


async def test_over_tls_too_and_after_the_handshake(spawn_remote: SpawnRemote) -> None:
    daemon = spawn_remote(tls=True, header_timeout_s=3)
    await daemon.wait_ready()
    elapsed, sent = await trickle_head("127.0.0.1", daemon.port, context=daemon.ssl_context(),
                                       within=10)
    assert 2 <= elapsed <= 5, elapsed
    assert sent < len(HEAD)


async def test_an_idle_keepalive_connection_and_a_trickled_body_are_closed(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    daemon = spawn_remote(idle_timeout_s=2, body_timeout_s=2)
    await daemon.wait_ready()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(HEAD)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    await reader.readexactly(length)
    idle_from = time.monotonic()
    assert await socket_closed(reader, 10) == b""  # idle: closed by the server
    assert 1 <= time.monotonic() - idle_from <= 5
    writer.close()

    device = await new_device(pool, "alice", "slow")
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(b"POST /v1/conversations HTTP/1.1\r\nHost: agentd\r\n"
                 b"Authorization: Bearer " + device.token.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    await writer.drain()
    answer = await socket_closed(reader, 10)  # the rest of the body never comes
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"
    assert await pool.fetchval("SELECT count(*) FROM conversation") == 0


async def test_connections_over_the_cap_get_a_503_and_the_cap_frees_up(
        spawn_remote: SpawnRemote) -> None:
    cap = 4
    daemon = spawn_remote(max_connections=cap)
    await daemon.wait_ready()
    held: list[asyncio.StreamWriter] = []
    async with daemon.client() as scraper:  # its connection holds one place throughout
        await only_this_connection_open(scraper)
        try:
            for _ in range(cap - 1):
                _, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
                held.append(writer)

            async def refused() -> bytes | None:
                reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
                try:
                    answer = await socket_closed(reader, 10)
                finally:
                    writer.close()
                return answer or None

            answer = await poll_until(refused, 10, interval=0.1, what="a refused connection")
            assert answer.startswith(b"HTTP/1.1 503"), answer
            assert b"Retry-After: 1" in answer
            body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "too_many_connections"
        finally:
            for writer in held:
                writer.close()

    async def served() -> bool:
        try:
            return (await daemon.request("GET", "/metrics")).status_code == 200
        except httpx.TransportError:
            return False

    await poll_until(served, 10, interval=0.1, what="room again under the cap")
    metrics = (await daemon.request("GET", "/metrics")).text
    assert metric(metrics, "agentd_connections_refused_total") >= 1


async def test_one_address_holds_at_most_its_share_of_connections_and_loopback_is_not_capped(
        spawn_remote: SpawnRemote) -> None:
    """One host could take every place under max_connections, and with it the daemon from
    every other client. It now holds at most max_connections_per_address; this machine's own
    loopback (the local TUI, a proxy beside the daemon) is not capped."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    share = 3
    daemon = spawn_remote(host="0.0.0.0", env={"AGENTD_TLS": "off", "AGENTD_INSECURE_HTTP": "1"},
                          max_connections=10, max_connections_per_address=share)

    async def answer(host: str) -> bytes:
        try:
            reader, writer = await asyncio.open_connection(host, daemon.port)
        except ConnectionRefusedError:  # not listening yet
            return b""
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await writer.drain()
            return await socket_closed(reader, 10)
        except ConnectionError:
            return b""
        finally:
            writer.close()

    async def ready() -> bool:
        return (await answer("127.0.0.1")).startswith(b"HTTP/1.1 200")

    await poll_until(ready, 30, interval=0.1, what="the daemon to serve")
    held: list[asyncio.StreamWriter] = []
    try:
        for _ in range(share):  # from the other address: its whole share
            _, writer = await asyncio.open_connection(address, daemon.port)
            held.append(writer)

        async def refused() -> bytes | None:
            over = await answer(address)
            return over if over.startswith(b"HTTP/1.1 503") else None

        over = await poll_until(refused, 10, interval=0.1, what="a refused connection")
        error = json.loads(over.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "too_many_connections"
        assert "this address" in error["message"]
        # Loopback is served meanwhile, well past the other address's share.
        loopback = []
        for _ in range(share + 2):
            _, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
            loopback.append(writer)
        held += loopback
        assert (await answer("127.0.0.1")).startswith(b"HTTP/1.1 200")
        held.pop(0).close()  # a place of the address's share is free again

        async def served() -> bool:
            return (await answer(address)).startswith(b"HTTP/1.1 200")

        await poll_until(served, 10, interval=0.1, what="room again in the address's share")
    finally:
        for writer in held:
            writer.close()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{daemon.port}",
                                 trust_env=False) as local:
        metrics = (await local.get("/metrics")).text
    assert metric(metrics, "agentd_connections_refused_per_address_total") >= 1


async def test_a_new_connection_that_sends_nothing_is_closed_within_the_head_timeout(
        spawn_remote: SpawnRemote) -> None:
    """Its place under the cap is not held until aiohttp's idle timeout (60 s)."""
    daemon = spawn_remote(header_timeout_s=2)
    await daemon.wait_ready()
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    try:
        # Closed with nothing said, well before aiohttp's idle timeout would have (60 s).
        assert await socket_closed(reader, 15) == b""
    finally:
        writer.close()
    assert "did not arrive in time" in daemon.log_text()


async def test_connections_still_in_their_tls_handshake_count_against_the_cap(
        spawn_remote: SpawnRemote) -> None:
    """Over TLS a connection counts from its accept, not from the end of its handshake: bare
    TCP connections that never send a hello fill the cap, and the next client is refused
    (over TLS, with the same 503). Before, they were not counted at all, so anyone could
    hold as many as the open-files limit."""
    cap = 4
    daemon = spawn_remote(tls=True, max_connections=cap, header_timeout_s=30)
    await daemon.wait_ready()
    context = daemon.ssl_context()

    async def answer_to_a_request() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port, ssl=context,
                                                       server_hostname="127.0.0.1")
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await writer.drain()
            return await socket_closed(reader, 10)
        finally:
            writer.close()

    assert (await answer_to_a_request()).startswith(b"HTTP/1.1 200")
    silent: list[asyncio.StreamWriter] = []
    async with daemon.client() as scraper:  # its connection holds one place throughout
        await only_this_connection_open(scraper)
        try:
            for _ in range(cap - 1):  # no TLS hello: they sit in their handshake
                _, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
                silent.append(writer)

            async def refused() -> bytes | None:
                answer = await answer_to_a_request()
                return answer if answer.startswith(b"HTTP/1.1 503") else None

            answer = await poll_until(refused, 10, interval=0.1, what="a refused connection")
            body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "too_many_connections"
        finally:
            for writer in silent:
                writer.close()

    async def served() -> bool:
        return (await answer_to_a_request()).startswith(b"HTTP/1.1 200")

    await poll_until(served, 10, interval=0.1, what="room again under the cap")


async def test_an_address_whose_tokens_name_no_one_is_refused_before_the_lookup(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    """Every bearer token costs a database read: past AUTH_FAILURES_PER_MIN unknown tokens an
    address gets 429 too_many_attempts, its tokens not looked up (nothing was counted before,
    so anyone could make the daemon read the database as fast as it could ask)."""
    daemon = spawn_remote()
    await daemon.wait_ready()
    device = await new_device(pool, "alice", "laptop")
    known = await new_device(pool, "alice", "desk")
    async with known.client(daemon) as desk:
        assert (await desk.get("/v1/me")).status_code == 200  # before the guessing starts
    async with daemon.client(headers={"Authorization": "Bearer agd_guess"}) as guesser:
        answers = []
        # The bucket refills while it is spent (AUTH_FAILURES_PER_MIN a minute): a few more
        # than the burst may pass before the first refusal.
        for _ in range(2 * AUTH_FAILURES_PER_MIN):
            over = await guesser.get("/v1/me")
            answers.append(over.status_code)
            if over.status_code != 401:
                break
        assert answers[-1] == 429 and answers.count(401) >= AUTH_FAILURES_PER_MIN, answers
        assert set(answers[:-1]) == {401}
        assert over.json()["error"]["code"] == "too_many_attempts"
        assert int(over.headers["Retry-After"]) >= 1
        # While the guessing goes on, the same address with a token not seen working waits
        # too (it cannot be told apart first); one that named a device lately goes on: the
        # devices behind a guesser's proxy or NAT were all refused with it before.
        async with known.client(daemon) as desk:
            unseen = []
            for n in range(5):
                await guesser.get("/v1/me")
                # A token never seen here each time (one let through, now and then, when the
                # bucket refills just between the two, is known from then on).
                other = device if n == 0 else await new_device(pool, "alice", f"tablet {n}")
                async with other.client(daemon) as laptop:
                    unseen.append((await laptop.get("/v1/me")).status_code)
                await guesser.get("/v1/me")
                assert (await desk.get("/v1/me")).status_code == 200
            assert 429 in unseen, unseen
    metrics = (await daemon.request("GET", "/metrics")).text
    assert 'agentd_throttled_total{reason="too_many_attempts"}' in metrics


async def test_guesses_sent_together_spend_the_bucket_before_their_lookups(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    """Unknown tokens sent together: no more are looked up than the bucket holds. The attempt
    used to be spent only after the lookup, so every request that arrived while lookups were
    in flight passed a bucket that held a single attempt. Here the lookups are held in flight
    (the device table locked) while the guesses arrive."""
    daemon = spawn_remote()
    await daemon.wait_ready()
    burst = 100
    limits = httpx.Limits(max_connections=burst, max_keepalive_connections=burst)
    async with daemon.client(headers={"Authorization": "Bearer agd_guess"}, timeout=30.0,
                             limits=limits) as guesser:
        spent_first = AUTH_FAILURES_PER_MIN - 50
        begun = time.monotonic()
        for n in range(spent_first):
            assert (await guesser.get("/v1/me")).status_code == 401, n
        # 50 attempts left, and what the bucket gained meanwhile (AUTH_FAILURES_PER_MIN a
        # minute), with a second's more for the burst to arrive.
        refilled = (time.monotonic() - begun + 1) * AUTH_FAILURES_PER_MIN / 60
        left = AUTH_FAILURES_PER_MIN - spent_first + math.ceil(refilled)
        async with pool.acquire() as conn, conn.transaction():
            # Under the daemon's lock_timeout (5 s): the held lookups wait, they do not fail.
            await conn.execute("LOCK TABLE device IN ACCESS EXCLUSIVE MODE")
            guesses = [asyncio.ensure_future(guesser.get("/v1/me")) for _ in range(burst)]
            # Those past the bucket are refused without a lookup, so while the lookups wait.
            # Polled within the daemon's lock_timeout (5 s), after which the held lookups fail;
            # a loaded host takes seconds to open the burst's connections.
            await poll_until(lambda: sum(g.done() for g in guesses) >= burst - left, 4.5,
                             what="the guesses past the bucket refused before any lookup")
        codes = [g.status_code for g in await asyncio.gather(*guesses)]
    assert set(codes) <= {401, 429}, codes
    assert codes.count(401) <= left, codes.count(401)


async def test_tokens_guessed_at_metrics_count_as_guesses(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    """/metrics and /readyz look a token up too (from another host): their unknown tokens are
    guesses like any other. They were looked up without a limit."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to listen on")
    daemon: RemoteDaemon = spawn_remote(tls=True, host=address, env={"AGENTD_TLS": "auto"})
    await daemon.wait_ready()
    async with daemon.client(headers={"Authorization": "Bearer agd_guess"}) as guesser:
        for n in range(AUTH_FAILURES_PER_MIN):
            assert (await guesser.get("/metrics")).status_code == 401, n
        # The bucket refills while it is spent: a few more may pass, those that came back
        # meanwhile (before, the metrics' guesses were not counted at all: another
        # AUTH_FAILURES_PER_MIN would have passed).
        passed = 0
        for _ in range(AUTH_FAILURES_PER_MIN):
            over = await guesser.get("/v1/me")
            if over.status_code != 401:
                break
            passed += 1
        assert over.status_code == 429 and passed < AUTH_FAILURES_PER_MIN // 2, (passed,
                                                                                 over.text)
        assert over.json()["error"]["code"] == "too_many_attempts"
        # Readiness still answers, without its detail; metrics still refuse.
        ready = await guesser.get("/readyz")
        assert ready.status_code == 200 and set(ready.json()) == {"status"}
        assert (await guesser.get("/metrics")).status_code == 401


async def test_operational_detail_only_for_loopback_or_a_token(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to listen on")
    daemon: RemoteDaemon = spawn_remote(tls=True, host=address, env={"AGENTD_TLS": "auto"})
    await daemon.wait_ready()
    device = await new_device(pool, "alice", "monitor")
    token = {"Authorization": f"Bearer {device.token}"}
    # This test's connections come from `address`: another host, as far as agentd can tell.
    metrics = await daemon.request("GET", "/metrics")
    assert metrics.status_code == 401 and metrics.json()["error"]["code"] == "unauthorized"
    assert "agentd_" not in metrics.text
    wrong = await daemon.request("GET", "/metrics", headers={"Authorization": "Bearer agd_x"})
    assert wrong.status_code == 401
    allowed = await daemon.request("GET", "/metrics", headers=token)
    assert allowed.status_code == 200 and "agentd_runs_queued" in allowed.text
    # Another account's name and activity are not for this device: the series per account
    # go to the host's own (loopback) scraper alone.
    bob = await new_account(pool, "bob-the-busy")
    busy = await enqueue_demo(pool, bob, await new_conversation(pool, bob), "busy",
                              tokens=400, delay_ms=50)
    await wait_status(pool, busy.run_id, "running", timeout=15)
    scraped = (await daemon.request("GET", "/metrics", headers=token)).text
    assert "agentd_runs_running 1.0" in scraped
    assert "bob-the-busy" not in scraped and "agentd_account_" not in scraped
    await pool.execute("UPDATE agent_run SET cancel_requested = true WHERE id = $1",
                       busy.run_id)

    assert (await daemon.request("GET", "/readyz")).json() == {"status": "ready"}
    detail = (await daemon.request("GET", "/readyz", headers=token)).json()
    assert detail["status"] == "ready" and detail["database"] is True and "worker_id" in detail
    assert (await daemon.request("GET", "/healthz")).json() == {"status": "ok"}


async def test_the_head_timer_never_cuts_a_request_in_progress_or_a_reused_connection(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    daemon = spawn_remote(header_timeout_s=1, keepalive_s=1)
    await daemon.wait_ready()
    device = await new_device(pool, "alice", "patient")
    async with device.client(daemon) as client, asyncio.timeout(60):
        conversation = await create_conversation(client)
        async with client.stream("GET", f"/v1/conversations/{conversation}/events") as feed:
            assert feed.status_code == 200
            started = time.monotonic()
            keepalives = 0
            async for chunk in feed.aiter_text():  # a stream lasting many head timeouts
                keepalives += chunk.count(": keepalive")
                if keepalives >= 4:
                    break
            assert time.monotonic() - started >= 3
        # The same pooled connection, quiet for several head timeouts, still serves.
        first = await client.get("/v1/me")
        await asyncio.sleep(2.5)  # idle on purpose: longer than the head timeout
        second = await client.get("/v1/me")
        assert first.status_code == second.status_code == 200
    assert "did not arrive in time" not in daemon.log_text()
