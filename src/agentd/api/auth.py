"""Bearer-token authentication for /v1: a token resolves to (account, device) or the call is 401.

Runs before any handler, so no lease or run is ever touched on behalf of an unknown caller. The
one exception is POST /v1/pair, where a pairing code stands in for the token (rate-limited).
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.typedefs import Handler

from agentd.accounts import Principal, authenticate, hash_token
from agentd.api import RUNTIME
from agentd.api.errors import error_response
from agentd.limits import Throttled, loopback_address, peer_address

UNAUTHENTICATED = frozenset({("POST", "/v1/pair")})

PRINCIPAL = web.RequestKey("principal", Principal)


def principal(request: web.Request) -> Principal:
    return request[PRINCIPAL]


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not request.path.startswith("/v1/") or (request.method, request.path) in UNAUTHENTICATED:
        return await handler(request)
    token = _bearer(request)
    if not token:
        return _unauthorized("missing bearer token")
    who = await _looked_up(request, token)
    if who is None:
        return _unauthorized("unknown or revoked token")
    request[PRINCIPAL] = who
    return await handler(request)


async def _looked_up(request: web.Request, token: str) -> Principal | None:
    """Who `token` names. Each token costs a database read: an address whose tokens keep naming
    no one is refused before the read (Throttled), as pairing attempts are, unless this token
    named a device lately (limits.RecentlyValid: the devices behind a guesser's proxy or NAT go
    on). The attempt is spent before the read and given back if the token names a device:
    spent only after it, requests sent together all passed a bucket that held one attempt."""
    runtime = request.app[RUNTIME]
    address = peer_address(request)
    # Tokens are printable ASCII; anything else (a header's undecodable bytes) names no one.
    digest = hash_token(token) if token.isascii() and token.isprintable() else b""
    spent = digest not in runtime.valid_tokens
    if spent:
        wait = runtime.auth_failures.take(address)
        if wait is not None:
            raise Throttled("too_many_attempts", "too many requests with unknown or revoked "
                            "tokens from this address; wait and retry", wait)
    try:
        who = await _principal_of(request, token)
    except asyncio.CancelledError:
        raise  # the client left while it was looked up: the attempt stays spent
    except BaseException:
        if spent:  # never judged (the database failed): not a failure
            runtime.auth_failures.give_back(address)
        raise
    if who is None:
        runtime.valid_tokens.discard(digest)
    else:
        if spent:
            runtime.auth_failures.give_back(address)
        runtime.valid_tokens.add(digest)
    return who


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > 512:
        return None
    return token


async def _principal_of(request: web.Request, token: str) -> Principal | None:
    if not (token.isascii() and token.isprintable()):
        # Tokens are printable ASCII; anything else (a header's undecodable bytes) names no one.
        return None
    return await authenticate(request.app[RUNTIME].pool, token)


def loopback_peer(request: web.Request) -> bool:
    """Whether the request came over this machine's loopback (not from another host)."""
    return loopback_address(peer_address(request))


async def trusted(request: web.Request) -> bool:
    """May this caller see operational detail (metrics, readiness detail)?

    A loopback peer, or any valid device token. A reverse proxy on this host makes every
    client look local: docs/operations.md says to keep /metrics off such a proxy.
    """
    if loopback_peer(request):
        return True
    token = _bearer(request)
    if token is None:
        return False
    try:
        return await _looked_up(request, token) is not None
    except Throttled:
        return False  # an address refused for guessing is not looked up here either


DEVICE_REVOKED = "device_revoked"  # what a revocation that cuts a request or stream short says


def _unauthorized(message: str, code: str = "unauthorized") -> web.Response:
    return error_response(401, code, message,
                          headers={"WWW-Authenticate": 'Bearer realm="agentd"'})


def device_revoked(message: str) -> web.Response:
    """A request the device's revocation cut short (a long wait): the code streams end with."""
    return _unauthorized(message, DEVICE_REVOKED)
