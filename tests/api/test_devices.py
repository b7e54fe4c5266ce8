"""Devices and pairing over HTTP: the documented success shapes and the 4xx of each endpoint.

How pairing holds up under attack and races (expiry, reuse, guessing, concurrent redemption)
is tests/remote/test_pairing.py; revocation's effect on live streams, tests/remote.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import httpx

from agentd.accounts import authenticate
from tests.api.conftest import Api
from tests.api.helpers import assert_error, assert_json, assert_time, assert_uuid, db_state

CODE = re.compile(r"^[0-9A-HJKMNP-TV-Z]{5}-[0-9A-HJKMNP-TV-Z]{5}$")


async def pair(api: Api, body: Any) -> httpx.Response:
    async with api.client() as anonymous:  # no bearer token: the code is the credential
        return await anonymous.post("/v1/pair", json=body)


async def test_a_device_mints_a_code_another_redeems_it_once(api: Api):
    minted = await api.a.post("/v1/pairings", json={"device": "tablet"})
    assert minted.status_code == 201, minted.text
    pairing = assert_json(minted)
    assert set(pairing) == {"code", "expires_at", "url", "fingerprint", "command"}
    assert CODE.match(pairing["code"]), pairing
    assert_time(pairing["expires_at"], "expires_at")
    assert pairing["fingerprint"] is None  # plain HTTP on loopback: nothing to pin
    assert pairing["command"] == f"agenttui login {api.url} --code {pairing['code']}"
    stored = await api.pool.fetchrow("SELECT * FROM pairing")
    assert pairing["code"] not in str(dict(stored))  # only its hash is kept

    # Typed the way a person would: lower case, spaces for the dash, O for 0 and I for 1.
    typed = pairing["code"].lower().replace("-", " ").replace("0", "o").replace("1", "i")
    redeemed = await pair(api, {"code": typed, "device": "ignored: the minter named it"})
    assert redeemed.status_code == 201, redeemed.text
    assert redeemed.headers["Cache-Control"] == "no-store"
    body = assert_json(redeemed)
    assert set(body) == {"token", "account", "account_id", "device", "device_id"}
    assert (body["account"], body["device"]) == ("alice", "tablet")
    assert_uuid(body["device_id"])
    who = await authenticate(api.pool, body["token"])
    assert who is not None and str(who.device_id) == body["device_id"]
    async with api.client(body["token"]) as tablet:
        assert (await tablet.get("/v1/me")).json()["device"] == "tablet"

    before = await db_state(api.pool)
    again = await pair(api, {"code": pairing["code"], "device": "second try"})
    assert_error(again, 401, "invalid_pairing_code")
    assert await db_state(api.pool) == before  # a spent code creates nothing


async def test_devices_are_listed_without_secrets_and_revoked_by_their_account(api: Api):
    minted = assert_json(await api.a.post("/v1/pairings"))
    phone = assert_json(await pair(api, {"code": minted["code"], "device": "phone"}))
    assert phone["device"] == "phone"  # minted without a name: the redeemer's

    listing = await api.a.get("/v1/devices")
    assert listing.status_code == 200
    devices = assert_json(listing)["devices"]
    assert [d["name"] for d in devices] == ["laptop", "phone"]
    for device in devices:
        assert set(device) == {"id", "name", "created_at", "last_seen_at", "revoked_at",
                               "current"}
        assert_time(device["created_at"])
    assert [d["current"] for d in devices] == [True, False]
    assert phone["token"] not in listing.text and "token" not in listing.text

    revoked = await api.a.delete(f"/v1/devices/{phone['device_id']}")
    assert revoked.status_code == 200
    assert set(revoked.json()) == {"revoked", "revoked_at"}
    assert revoked.json()["revoked"] == phone["device_id"]
    async with api.client(phone["token"]) as old_phone:
        assert_error(await old_phone.get("/v1/me"), 401, "unauthorized")
    devices = (await api.a.get("/v1/devices")).json()["devices"]
    assert devices[1]["revoked_at"] == revoked.json()["revoked_at"]
    # Sent again (a script whose first answer was lost): the same answer, nothing changed.
    before = await db_state(api.pool)
    again = await api.a.delete(f"/v1/devices/{phone['device_id']}")
    assert again.status_code == 200 and again.json() == revoked.json()
    assert await db_state(api.pool) == before
    assert_error(await api.a.delete(f"/v1/devices/{uuid.uuid4()}"), 404, "not_found")
    # Another account's device is not found, revoked or not.
    assert_error(await api.b.delete(f"/v1/devices/{phone['device_id']}"), 404, "not_found")
    # A code minted by a device that is revoked since is worth nothing.
    async with api.client(phone["token"]) as old_phone:
        assert_error(await old_phone.post("/v1/pairings"), 401, "unauthorized")


async def test_bad_pairing_requests_are_4xx_and_create_nothing(api: Api):
    before = await db_state(api.pool)
    for body, code in (({}, "invalid_code"), ({"code": 5}, "invalid_code"),
                       ({"code": ""}, "invalid_code"), ({"code": "x" * 65}, "invalid_code"),
                       ({"code": "ABCDE-FGHJK", "extra": 1}, "invalid_body"),
                       ({"code": "ABCDE-FGHJK", "device": ""}, "invalid_device"),
                       ({"code": "ABCDE-FGHJK", "device": "a\nb"}, "invalid_device"),
                       (["ABCDE-FGHJK"], "invalid_body")):
        assert_error(await pair(api, body), 400, code)
    assert_error(await pair(api, {"code": "not a code at all"}), 401, "invalid_pairing_code")
    assert_error(await api.a.post("/v1/pairings", json={"device": " "}), 400, "invalid_device")
    assert_error(await api.a.post("/v1/pairings", json={"name": "x"}), 400, "invalid_body")
    assert await db_state(api.pool) == before
