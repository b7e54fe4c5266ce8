"""agentd's HTTP surface (aiohttp): handlers call the service layer, never SQL directly."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:  # the daemon imports the API, not the other way round
    from agentd.runtime import Runtime

RUNTIME: web.AppKey[Runtime] = web.AppKey("runtime")
"""The running daemon's pool, hub, settings and dispatcher, for handlers that need them."""
