"""Pairing codes under pressure: spent once, dead when expired, guessing throttled per address,
and one code raced from many independent connections on two daemons mints exactly one device.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import httpx

from agentd import pairing
from agentd.accounts import ensure_account
from tests.remote.helpers import RemoteDaemon, SpawnRemote
from tests.support.daemon import poll_until
from tests.support.factories import new_device
from tests.support.races import lose_races, race_attempts

RACERS = 8
ROUNDS = 25


async def mint(pool: asyncpg.Pool, device: str | None = None) -> str:
    account_id = await ensure_account(pool, "alice")
    made = await pairing.create_pairing(pool, account_id=account_id, device_name=device,
                                        created_by=None, ttl_s=600)
    return made.code


async def redeem(daemon: RemoteDaemon, code: str, device: str = "new",
                 source: str | None = None) -> httpx.Response:
    """POST /v1/pair on a connection of its own (from `source`, when given)."""
    transport = httpx.AsyncHTTPTransport(local_address=source) if source else None
    async with daemon.client(transport=transport) as client:
        return await client.post("/v1/pair", json={"code": code, "device": device})


async def devices(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT count(*) FROM device")


async def test_a_code_works_once_and_not_after_it_expired(spawn_remote: SpawnRemote,
                                                          pool: asyncpg.Pool) -> None:
    daemon = spawn_remote()
    await daemon.wait_ready()
    code = await mint(pool)
    first = await redeem(daemon, code, "first")
    assert first.status_code == 201, first.text
    again = await redeem(daemon, code, "second")
    assert again.status_code == 401 and again.json()["error"]["code"] == "invalid_pairing_code"
    assert await devices(pool) == 1

    late = await mint(pool)
    # Ten minutes pass, on the database clock that decides expiry.
    await pool.execute("UPDATE pairing SET created_at = created_at - interval '11 minutes', "
                       "expires_at = expires_at - interval '11 minutes' WHERE used_at IS NULL")
    expired = await redeem(daemon, late, "too late")
    assert expired.status_code == 401
    assert expired.json()["error"]["code"] == "invalid_pairing_code"
    assert await devices(pool) == 1
    assert await pool.fetchval("SELECT count(*) FROM pairing WHERE used_at IS NULL") == 1


async def test_guessing_from_one_address_is_throttled_and_creates_nothing(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    daemon = spawn_remote(pair_attempts_per_min=5)
    await daemon.wait_ready()
    code = await mint(pool)
    statuses = []
    for guess in range(5):
        response = await redeem(daemon, f"{guess:05d}-00000")
        statuses.append(response.status_code)
        assert response.json()["error"]["code"] == "invalid_pairing_code"
    assert statuses == [401] * 5
    throttled = await redeem(daemon, "99999-00000")
    assert throttled.status_code == 429
    assert throttled.json()["error"]["code"] == "too_many_attempts"
    assert int(throttled.headers["Retry-After"]) >= 1
    # Even the right code waits: the limit comes before the code is looked at.
    assert (await redeem(daemon, code)).status_code == 429
    assert await devices(pool) == 0
    # Another address has its own allowance (127.0.0.2 is loopback too, but another peer).
    other = await redeem(daemon, code, "from elsewhere", source="127.0.0.2")
    assert other.status_code == 201, other.text
    assert await devices(pool) == 1


async def test_a_redeem_that_loses_a_race_is_a_503_that_costs_no_attempt(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    """A redeem that loses a race with other transactions rolled back whole: the code is not
    spent, and the address keeps the attempt, so the retry the 503 asks for is not refused."""
    daemon = spawn_remote(pair_attempts_per_min=2)
    await daemon.wait_ready()
    code = await mint(pool)
    await lose_races(pool, times=3, on="UPDATE ON pairing")
    for _ in range(3):
        lost = await redeem(daemon, code)
        assert lost.status_code == 503, lost.text
        assert lost.json()["error"]["code"] == "unavailable"
    assert await race_attempts(pool) == 3
    assert await devices(pool) == 0
    assert await pool.fetchval("SELECT count(*) FROM pairing WHERE used_at IS NULL") == 1
    redeemed = await redeem(daemon, code)
    assert redeemed.status_code == 201, redeemed.text
    assert await devices(pool) == 1
    # Wrong guesses still spend: the limit of two allows one more, then refuses.
    assert (await redeem(daemon, "00000-00000")).status_code == 401
    assert (await redeem(daemon, "00000-00001")).status_code == 429


async def test_one_code_raced_from_many_connections_mints_exactly_one_device(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    # Two daemons, so the race is between processes and database connections, not one loop.
    daemons = [spawn_remote(name=f"agentd-{i}", pair_attempts_per_min=10_000) for i in (1, 2)]
    for daemon in daemons:
        await daemon.wait_ready()
    clients = [daemons[i % 2].client(timeout=30.0) for i in range(RACERS)]
    try:
        for client in clients:  # connections open before the race, so they start together
            assert (await client.get("/healthz")).status_code == 200
        for round_ in range(ROUNDS):
            code = await mint(pool)
            gate = asyncio.Event()

            async def racer(client: httpx.AsyncClient, n: int, code: str = code,
                            gate: asyncio.Event = gate) -> Any:
                await gate.wait()
                return await client.post("/v1/pair", json={"code": code, "device": f"r{n}"})

            tasks = [asyncio.create_task(racer(c, n)) for n, c in enumerate(clients)]
            gate.set()  # all released in the same turn of the loop
            answers = await asyncio.gather(*tasks)
            statuses = sorted(a.status_code for a in answers)
            assert statuses == [201] + [401] * (RACERS - 1), (round_, statuses)
            assert await devices(pool) == round_ + 1
    finally:
        for client in clients:
            await client.aclose()
    assert await pool.fetchval("SELECT count(*) FROM pairing WHERE device_id IS NOT NULL") \
        == ROUNDS


async def test_an_account_holds_a_bounded_number_of_open_codes(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    """Any logged-in device could mint codes without end, each a row kept for days. An account
    now holds at most MAX_OPEN_CODES codes neither used nor expired; a used one makes room."""
    daemon = spawn_remote()
    await daemon.wait_ready()
    device = await new_device(pool, "alice", "laptop")
    async with device.client(daemon) as laptop:
        codes = []
        for n in range(pairing.MAX_OPEN_CODES):
            made = await laptop.post("/v1/pairings", json={})
            assert made.status_code == 201, (n, made.text)
            codes.append(made.json()["code"])
        over = await laptop.post("/v1/pairings", json={})
        assert over.status_code == 429, over.text
        assert over.json()["error"]["code"] == "too_many_pairings"
        assert int(over.headers["Retry-After"]) >= 1
        assert await pool.fetchval("SELECT count(*) FROM pairing") == pairing.MAX_OPEN_CODES
        assert (await redeem(daemon, codes[0], "tablet")).status_code == 201
        assert (await laptop.post("/v1/pairings", json={})).status_code == 201


async def test_codes_minted_together_never_pass_the_bound(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    """The count and the insert were one statement: mints sent together each counted the codes
    committed before any of them, and all passed (the bound overshot by as many as ran at
    once). Raced from independent connections, the codes removed between rounds."""
    daemon = spawn_remote()
    await daemon.wait_ready()
    device = await new_device(pool, "alice", "laptop")
    racers = 3 * pairing.MAX_OPEN_CODES // 2
    limits = httpx.Limits(max_connections=racers, max_keepalive_connections=racers)
    async with daemon.client(headers=device.headers, limits=limits, timeout=30.0) as laptop:
        for _ in range(15):
            await pool.execute("DELETE FROM pairing")
            # 19 open: the last slot is what every racer competes for.
            for _ in range(pairing.MAX_OPEN_CODES - 1):
                assert (await laptop.post("/v1/pairings", json={})).status_code == 201
            gate, parked = asyncio.Event(), [0]

            async def mint(gate: asyncio.Event = gate, parked: list[int] = parked) -> int:
                parked[0] += 1
                await gate.wait()
                return (await laptop.post("/v1/pairings", json={})).status_code

            minting = [asyncio.ensure_future(mint()) for _ in range(racers)]
            await poll_until(lambda parked=parked: parked[0] == racers, 10,
                             what="every racer at the gate")
            gate.set()  # all post at once
            codes = await asyncio.gather(*minting)
            assert sorted(set(codes)) == [201, 429], codes
            assert codes.count(201) == 1, codes.count(201)
            assert await pool.fetchval("SELECT count(*) FROM pairing") == \
                pairing.MAX_OPEN_CODES


async def test_codes_a_revoked_device_minted_no_longer_fill_its_account(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool) -> None:
    """A stolen device fills its account with codes and is revoked: its codes redeem nothing,
    and they no longer count either (until they expired, nobody could pair a new device)."""
    daemon = spawn_remote()
    await daemon.wait_ready()
    owner = await new_device(pool, "alice", "laptop")
    stolen = await new_device(pool, "alice", "phone")
    async with stolen.client(daemon) as thief:
        codes = [(await thief.post("/v1/pairings", json={})).json()["code"]
                 for _ in range(pairing.MAX_OPEN_CODES)]
    async with owner.client(daemon) as laptop:
        assert (await laptop.post("/v1/pairings", json={})).status_code == 429
        assert (await laptop.delete(f"/v1/devices/{stolen.device_id}")).status_code in (200, 204)
        made = await laptop.post("/v1/pairings", json={})
        assert made.status_code == 201, made.text
    assert (await redeem(daemon, codes[0], "the thief's")).status_code != 201
    assert (await redeem(daemon, made.json()["code"], "tablet")).status_code == 201
