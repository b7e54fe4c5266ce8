"""GET /metrics: this process's Prometheus metrics and the shared queue, via prometheus-client.

The exposition (text or OpenMetrics, as the scraper's Accept header asks) is the library's; the
queue figures are read from the database at each scrape, so every process reports the fleet's.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from agentd.api import RUNTIME
from agentd.queue import queue_status


async def metrics(request: web.Request) -> web.Response:
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
