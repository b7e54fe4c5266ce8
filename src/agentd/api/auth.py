"""Bearer-token authentication for /v1: a token resolves to (account, device) or the call is 401.

Runs before any handler, so no lease or run is ever touched on behalf of an unknown caller.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from agentd.accounts import Principal, authenticate
from agentd.api import RUNTIME
from agentd.api.errors import error_response

PRINCIPAL = web.AppKey("principal", Principal)


def principal(request: web.Request) -> Principal:
    return request[PRINCIPAL]


@web.middleware
async def auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    if not request.path.startswith("/v1/"):
        return await handler(request)
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > 512:
        return _unauthorized("missing bearer token")
    if not (token.isascii() and token.isprintable()):
        # Tokens are printable ASCII; anything else (a header's undecodable bytes) names no one.
        return _unauthorized("unknown or revoked token")
    who = await authenticate(request.app[RUNTIME].pool, token)
    if who is None:
        return _unauthorized("unknown or revoked token")
    request[PRINCIPAL] = who
    return await handler(request)


def _unauthorized(message: str) -> web.Response:
    return error_response(401, "unauthorized", message,
                          headers={"WWW-Authenticate": 'Bearer realm="agentd"'})
