"""GET /metrics: this process's Prometheus metrics and the shared queue, via prometheus-client.

Only for a loopback peer or a device token: the queue figures are the whole fleet's. The series
per account name other accounts, so they go to loopback peers (the host's own scraper) alone: a
device of one account must not learn the others' names and activity. The exposition (text or
OpenMetrics, as the scraper's Accept header asks) is the library's; the queue figures are read
from the database at each scrape, so every process reports the fleet's.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from agentd.api import RUNTIME
from agentd.api.auth import loopback_peer, trusted
from agentd.api.errors import error_response
from agentd.conversations import count_attached_devices
from agentd.metrics import TOP_ACCOUNTS
from agentd.queue import queue_by_account, queue_status


async def metrics(request: web.Request) -> web.Response:
    if not await trusted(request):
        return error_response(401, "unauthorized",
                              "metrics answer only loopback clients or a device token",
                              headers={"WWW-Authenticate": 'Bearer realm="agentd"'})
    runtime = request.app[RUNTIME]
    series = runtime.metrics
    settings = runtime.settings
    queue = await queue_status(runtime.pool)
    series.runs_queued.set(queue.queued)
    series.runs_running.set(queue.running)
    series.leases_expired.set(queue.expired)
    for state, count in (("queued", queue.queued), ("running", queue.running)):
        series.queue_depth.labels(state=state).set(count)
    local = loopback_peer(request)
    # The busiest accounts now; an account that dropped out of them loses its series. Only
    # for a scraper that is shown them (another's scrape must not empty them meanwhile).
    busiest = await queue_by_account(runtime.pool, limit=TOP_ACCOUNTS) if local else None
    if busiest is not None:
        series.account_runs.clear()
        series.account_limit.clear()
    for account in busiest or ():
        series.account_runs.labels(account=account.account, state="queued").set(account.queued)
        series.account_runs.labels(account=account.account, state="running").set(
            account.running)
        series.account_limit.labels(account=account.account, limit="max_running").set(
            _or_default(account.max_running, settings.account_max_running))
        series.account_limit.labels(account=account.account, limit="max_queued").set(
            _or_default(account.max_queued, settings.account_max_queued))
    series.attached_devices.set(await count_attached_devices(runtime.pool))
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    shown = series.registry if local else _without_accounts(series.registry)
    return web.Response(body=encode(shown),
                        headers={"Content-Type": content_type,
                                 "X-Content-Type-Options": "nosniff"})


ACCOUNT_SERIES_PREFIX = "agentd_account_"  # the series that name accounts


def _without_accounts(registry: CollectorRegistry) -> Collector:
    """The registry without the series that name accounts (prometheus-client's own view)."""
    names = {sample.name for family in registry.collect() for sample in family.samples
             if not family.name.startswith(ACCOUNT_SERIES_PREFIX)}
    return registry.restricted_registry(names)


def _or_default(own: int | None, default: int) -> int:
    return default if own is None else own
