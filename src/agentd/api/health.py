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
from agentd.hub import DEAF_MESSAGE


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
    """Ready = the database answers, the hub listens, and we are not draining.

    A hub that listens but hears nothing (its LISTEN behind a transaction pooler) is still
    ready: everything works at the poll interval; the body says so.
    """
    runtime = request.app[RUNTIME]
    database = True
    try:
        async with asyncio.timeout(2):
            await ping(runtime.pool)
    except Exception:
        database = False
    hub = runtime.hub
    body: dict[str, object] = {"database": database, "hub": hub.listening,
                               "draining": runtime.draining, "worker_id": runtime.worker_id}
    if hub.deaf:
        body["hub_notifications"] = False
        body["hub_problem"] = DEAF_MESSAGE
    ready = database and hub.listening and not runtime.draining
    answer: dict[str, object] = {"status": "ready" if ready else "unready"}
    # Without the database no token can be checked: then only a loopback peer sees why.
    if loopback_peer(request) or (database and await trusted(request)):
        answer.update(body)
    return web.json_response(answer, status=200 if ready else 503)
