"""GET /metrics: Prometheus text exposition of this process and of the shared queue.

Only for a loopback peer or a device token: the queue figures are the whole fleet's.
"""

from __future__ import annotations

from aiohttp import web

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
    guard = runtime.connection_guard
    dispatcher = runtime.dispatcher
    queue = await queue_status(runtime.pool)
    lines = [
        "# HELP agentd_runs_queued Runs waiting to be claimed (whole fleet).",
        "# TYPE agentd_runs_queued gauge",
        f"agentd_runs_queued {queue.queued}",
        "# HELP agentd_runs_running Runs executing now (whole fleet).",
        "# TYPE agentd_runs_running gauge",
        f"agentd_runs_running {queue.running}",
        "# HELP agentd_leases_expired Running runs past their lease, awaiting the reaper.",
        "# TYPE agentd_leases_expired gauge",
        f"agentd_leases_expired {queue.expired}",
        "# HELP agentd_in_flight Turns this process is executing.",
        "# TYPE agentd_in_flight gauge",
        f"agentd_in_flight {len(dispatcher.in_flight) if dispatcher else 0}",
        "# HELP agentd_claimed_total Runs this process has claimed.",
        "# TYPE agentd_claimed_total counter",
        f"agentd_claimed_total {dispatcher.claimed if dispatcher else 0}",
        "# HELP agentd_hub_connected Whether the LISTEN connection is up.",
        "# TYPE agentd_hub_connected gauge",
        f"agentd_hub_connected {int(runtime.hub.connected)}",
        "# HELP agentd_hub_reconnects_total LISTEN reconnections.",
        "# TYPE agentd_hub_reconnects_total counter",
        f"agentd_hub_reconnects_total {runtime.hub.reconnects}",
        "# HELP agentd_hub_notifications_total NOTIFY hints received.",
        "# TYPE agentd_hub_notifications_total counter",
        f"agentd_hub_notifications_total {runtime.hub.notifications}",
        "# HELP agentd_hub_subscribers In-process subscriptions (tails, waiters, watchers).",
        "# TYPE agentd_hub_subscribers gauge",
        f"agentd_hub_subscribers {runtime.hub.subscriber_count()}",
        "# HELP agentd_pool_size Database connections open in this process's pool.",
        "# TYPE agentd_pool_size gauge",
        f"agentd_pool_size {runtime.pool.get_size()}",
        "# HELP agentd_connections_open HTTP connections open to this process.",
        "# TYPE agentd_connections_open gauge",
        f"agentd_connections_open {guard.open if guard else 0}",
        "# HELP agentd_connections_refused_total Connections refused at max_connections.",
        "# TYPE agentd_connections_refused_total counter",
        f"agentd_connections_refused_total {guard.refused if guard else 0}",
        "# HELP agentd_header_timeouts_total Connections closed for a slow request head.",
        "# TYPE agentd_header_timeouts_total counter",
        f"agentd_header_timeouts_total {guard.head_timeouts if guard else 0}",
        "# HELP agentd_streams_open SSE streams open on this process.",
        "# TYPE agentd_streams_open gauge",
        f"agentd_streams_open {runtime.stream_slots.total}",
    ]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain",
                        charset="utf-8", headers={"X-Content-Type-Options": "nosniff"})
