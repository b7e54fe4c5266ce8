"""Liveness and readiness: what a supervisor or load balancer asks.

Both answer anyone (a load balancer has no token); the detail — worker id, database and hub
state — only a loopback peer or a device token gets (agentd.api.auth.trusted).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from agentd.api import RUNTIME
from agentd.api.auth import loopback_peer, trusted
from agentd.db import ping


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)


async def healthz(request: web.Request) -> web.Response:
    """The process is up and its event loop answers (no database query: it stays cheap)."""
    body = {"status": "ok"}
    if loopback_peer(request):
        body["worker_id"] = request.app[RUNTIME].worker_id
    return web.json_response(body)


async def readyz(request: web.Request) -> web.Response:
    """Ready = the database answers, the hub listens, and we are not draining."""
    runtime = request.app[RUNTIME]
    database = True
    try:
        async with asyncio.timeout(2):
            await ping(runtime.pool)
    except Exception:
        database = False
    body = {"database": database, "hub": runtime.hub.connected, "draining": runtime.draining,
            "worker_id": runtime.worker_id}
    ready = database and runtime.hub.connected and not runtime.draining
    answer: dict[str, object] = {"status": "ready" if ready else "unready"}
    # Without the database no token can be checked: then only a loopback peer sees why.
    if loopback_peer(request) or (database and await trusted(request)):
        answer.update(body)
    return web.json_response(answer, status=200 if ready else 503)
