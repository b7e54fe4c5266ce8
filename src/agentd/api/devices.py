"""Devices and pairing: mint a one-time code, trade it for a token, list and revoke devices.

POST /v1/pair is the one /v1 call without a bearer token: the code stands in for it, so every
attempt first spends from its address's rate limit, and any failure is the same 401 whatever
went wrong (unknown, spent, expired), with nothing created.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import asyncpg
from aiohttp import web

from agentd import accounts, pairing, tls
from agentd.api import RUNTIME, wire
from agentd.api.auth import principal
from agentd.api.bodies import json_body
from agentd.limits import Throttled, peer_address
from agentd.queue import lost_race
from agentd.service import ServiceError, parse_uuid

MAX_DEVICE_NAME = 200
MAX_CODE_CHARS = 64
DEFAULT_DEVICE_NAME = "paired device"


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/v1/pair", redeem_pairing)
    r.add_post("/v1/pairings", create_pairing)
    r.add_get("/v1/devices", list_devices)
    r.add_delete("/v1/devices/{id}", revoke_device)


def login_command(url: str, code: str, fingerprint: str | None) -> str:
    """The exact line to run on the other machine."""
    line = f"agenttui login {url} --code {code}"
    return f"{line} --fingerprint {fingerprint}" if fingerprint else line


async def pairing_answer(runtime: Any, made: pairing.Pairing) -> dict[str, Any]:
    # Off the event loop: on a wildcard address the URL takes the host's name, a DNS lookup
    # that can take seconds, while every stream and lease of the process waits.
    url = await asyncio.to_thread(tls.public_url, runtime.settings)
    fingerprint = runtime.certificate.fingerprint if runtime.certificate else None
    return {"code": made.code, "expires_at": wire.ts(made.expires_at), "url": url,
            "fingerprint": fingerprint, "command": login_command(url, made.code, fingerprint)}


def _device_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_DEVICE_NAME \
            or not value.isprintable():
        raise ServiceError(400, "invalid_device", f"{what} must be a printable name of 1 to "
                           f"{MAX_DEVICE_NAME} characters")
    return value.strip()


async def _body(request: web.Request, *, optional: bool) -> dict[str, Any]:
    body = await json_body(request, optional=optional)
    if not isinstance(body, dict):
        raise ServiceError(400, "invalid_body", "the body must be a JSON object")
    return body


async def create_pairing(request: web.Request) -> web.Response:
    """A logged-in device mints a code for another device of its account."""
    runtime = request.app[RUNTIME]
    body = await _body(request, optional=True)
    unknown = set(body) - {"device"}
    if unknown:
        raise ServiceError(400, "invalid_body", f"unknown fields: {', '.join(sorted(unknown))}")
    name = _device_name(body["device"], "device") if body.get("device") is not None else None
    who = principal(request)
    try:
        made = await pairing.create_pairing(runtime.pool, account_id=who.account_id,
                                            device_name=name, created_by=who.device_id,
                                            ttl_s=runtime.settings.pairing_ttl_s)
    except pairing.TooManyOpenCodes as exc:
        raise ServiceError(429, "too_many_pairings", str(exc),
                           retry_after_s=math.ceil(runtime.settings.pairing_ttl_s)) from None
    return web.json_response(await pairing_answer(runtime, made), status=201)


async def redeem_pairing(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    address = peer_address(request)
    wait = runtime.pair_limiter.take(address)
    if wait is not None:
        raise Throttled("too_many_attempts", "too many pairing attempts from this address; "
                        "wait and retry", wait)
    body = await _body(request, optional=False)
    unknown = set(body) - {"code", "device"}
    if unknown:
        raise ServiceError(400, "invalid_body", f"unknown fields: {', '.join(sorted(unknown))}")
    code = body.get("code")
    if not isinstance(code, str) or not code or len(code) > MAX_CODE_CHARS:
        raise ServiceError(400, "invalid_code", "code must be the pairing code as printed "
                           "(e.g. 7K3QX-M9V2D)")
    device = body.get("device")
    # The name given when the code was minted wins over this one (see redeem_pairing).
    name = _device_name(device, "device") if device is not None else DEFAULT_DEVICE_NAME
    try:
        redeemed = await pairing.redeem(runtime.pool, code, name)
    except asyncpg.PostgresError as exc:
        if lost_race(exc):
            # Rolled back whole, the code unspent: a 503 to send again (api/errors.py), which
            # must not cost the address one of its attempts. Only a code that matched a live
            # row takes the locks a race is lost on, so a wrong guess always spends its attempt.
            runtime.pair_limiter.give_back(address)
        raise
    if redeemed is None:
        raise ServiceError(401, "invalid_pairing_code", "this pairing code is unknown, already "
                           "used or expired; ask for a new one (`agentd pair`)")
    who = redeemed.principal
    return web.json_response({"token": redeemed.token, "account": who.account_name,
                              "account_id": str(who.account_id), "device": who.device_name,
                              "device_id": str(who.device_id)}, status=201,
                             headers={"Cache-Control": "no-store"})


async def list_devices(request: web.Request) -> web.Response:
    who = principal(request)
    devices = await accounts.account_devices(request.app[RUNTIME].pool, who.account_id)
    return web.json_response({"devices": [
        {"id": str(d.id), "name": d.name, "created_at": wire.ts(d.created_at),
         "last_seen_at": wire.ts(d.last_seen_at) if d.last_seen_at else None,
         "revoked_at": wire.ts(d.revoked_at) if d.revoked_at else None,
         "current": d.id == who.device_id} for d in devices]})


async def revoke_device(request: web.Request) -> web.Response:
    who = principal(request)
    device_id = parse_uuid(request.match_info["id"], "device")
    revocation = await accounts.revoke_device(request.app[RUNTIME].pool, device_id,
                                              account_id=who.account_id)
    if revocation is None:
        raise ServiceError(404, "not_found", "no such device in this account")
    # The same answer for a device revoked before: a retry whose first answer was lost.
    return web.json_response({"revoked": str(device_id),
                              "revoked_at": wire.ts(revocation.revoked_at)})
