"""Liveness, readiness and metrics: what a supervisor or load balancer asks."""

from __future__ import annotations

import asyncio

from aiohttp import web

from agentd.api import RUNTIME
from agentd.db import ping


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)


async def healthz(request: web.Request) -> web.Response:
    """The process is up and its event loop answers."""
    return web.json_response({"status": "ok", "worker_id": request.app[RUNTIME].worker_id})


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
    return web.json_response({"status": "ready" if ready else "unready", **body},
                             status=200 if ready else 503)
