"""GET /metrics: this process's Prometheus metrics and the shared queue, via prometheus-client.

Only for a loopback peer or a device token: the queue figures are the whole fleet's. The
exposition (text or OpenMetrics, as the scraper's Accept header asks) is the library's; the queue
figures are read from the database at each scrape, so every process reports the fleet's.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from agentd.api import RUNTIME
from agentd.api.auth import trusted
from agentd.api.errors import error_response
from agentd.queue import queue_status


async def metrics(request: web.Request) -> web.Response:
    if not await trusted(request):
        return error_response(401, "unauthorized",
                              "metrics answer only loopback clients or a device token",
                              headers={"WWW-Authenticate": 'Bearer realm="agentd"'})
    runtime = request.app[RUNTIME]
    series = runtime.metrics
    queue = await queue_status(runtime.pool)
    series.runs_queued.set(queue.queued)
    series.runs_running.set(queue.running)
    series.leases_expired.set(queue.expired)
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return web.Response(body=encode(series.registry),
                        headers={"Content-Type": content_type,
                                 "X-Content-Type-Options": "nosniff"})
