"""agentd's HTTP surface (aiohttp): handlers call the service layer, never SQL directly."""

from typing import Any

from aiohttp import web

RUNTIME: web.AppKey[Any] = web.AppKey("runtime")
