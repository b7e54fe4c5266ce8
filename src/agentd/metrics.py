"""This process's Prometheus metrics (prometheus-client), on a registry of its own.

Each runtime owns one `Metrics`: the parts of the daemon that measure something get it passed in
and record into it; GET /metrics (api/metrics.py) renders it. A registry per runtime, not the
library's global one, so several daemons in one test process never share a series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

# Event-loop lag and pool waits: a healthy daemon sits in the first buckets; a lease of 30 s is
# in danger only far right.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Turns: from milliseconds (a queue that keeps up) to the default max_run_s.
TURN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0, 300.0, 600.0)
TOP_ACCOUNTS = 10  # per-account gauges: the busiest few, so the series count stays bounded


class Metrics:
    """The series of one agentd process. Names are part of the operations contract
    (docs/operations.md lists them with example alert rules)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Load and admission (the dispatcher claims only while these stay within bounds).
        self.loop_lag = Histogram(
            "agentd_event_loop_lag_seconds",
            "How late the event loop ran a timer: the delay every task of this process sees.",
            buckets=LAG_BUCKETS, registry=r)
        self.pool_wait = Histogram(
            "agentd_pool_wait_seconds",
            "How long taking a connection from this process's pool took.",
            buckets=LAG_BUCKETS, registry=r)
        self.holding_back = Gauge(
            "agentd_admission_holding_back",
            "1 while this process holds back from claiming because its loop lags or its pool "
            "waits beyond their bounds.", registry=r)
        self.holds = Counter(
            "agentd_admission_holds",
            "Times this process started holding back from claiming for load.", registry=r)
        # The beat: one statement renewing every lease of this process.
        self.beats = Counter(
            "agentd_heartbeats",
            "Beat statements sent (each renews every lease this process holds).", registry=r)
        self.beat_seconds = Histogram(
            "agentd_heartbeat_seconds", "Round trip of one beat statement.",
            buckets=LAG_BUCKETS, registry=r)
        self.beat_failures = Counter(
            "agentd_heartbeat_failures",
            "Beats that failed (connection lost, timeout) and were retried.", registry=r)
        self.leases_lost = Counter(
            "agentd_leases_lost",
            "Runs whose lease this process found gone at a beat (reaped or otherwise ended).",
            registry=r)
        # Claims and turns.
        self.claimed = Counter("agentd_claimed", "Runs this process has claimed.", registry=r)
        self.claim_batch = Histogram(
            "agentd_claim_batch_size", "Runs one claim statement took (0: nothing eligible).",
            buckets=(0, 1, 2, 4, 8, 16, 32), registry=r)
        self.enqueue_to_start = Histogram(
            "agentd_enqueue_to_start_seconds",
            "From a turn's enqueue to its claim (database clock): time spent queued.",
            buckets=TURN_BUCKETS, registry=r)
        self.first_token = Histogram(
            "agentd_time_to_first_token_seconds",
            "From a turn's start on this process to its first text delta.",
            buckets=TURN_BUCKETS, registry=r)
        self.run_seconds = Histogram(
            "agentd_run_duration_seconds", "How long turns ran on this process, by ending.",
            ["status"], buckets=TURN_BUCKETS, registry=r)
        self.reaped = Counter("agentd_reaped", "Runs this process's reaper finalized failed "
                              "(their worker stopped renewing the lease).", registry=r)
        self.fenced_writes = Counter(
            "agentd_fenced_writes",
            "Turns whose write was refused by the fence: the run was no longer ours.",
            registry=r)
        self.cancels = Counter(
            "agentd_cancels", "Turns stopped through this process (queued ones cancelled, "
            "running ones flagged).", registry=r)
        self.deadline_failures = Counter(
            "agentd_deadline_failures", "Turns failed with deadline_exceeded (max_run_s).",
            registry=r)
        self.throttled = Counter(
            "agentd_throttled", "Requests answered 429, by reason (the error code).",
            ["reason"], registry=r)
        self.delta_lag = Histogram(
            "agentd_stream_delta_lag_seconds",
            "From a text delta's journal write (database clock) to its send on a stream.",
            buckets=LAG_BUCKETS, registry=r)
        # The whole fleet's queue, read from the database at each scrape.
        self.runs_queued = Gauge("agentd_runs_queued", "Runs waiting to be claimed "
                                 "(whole fleet).", registry=r)
        self.runs_running = Gauge("agentd_runs_running", "Runs executing now (whole fleet).",
                                  registry=r)
        self.leases_expired = Gauge(
            "agentd_leases_expired", "Running runs past their lease, awaiting the reaper "
            "(whole fleet).", registry=r)
        self.queue_depth = Gauge("agentd_queue_depth", "Runs by state (whole fleet).",
                                 ["state"], registry=r)
        self.account_runs = Gauge(
            "agentd_account_runs", f"Queued and running runs of the {TOP_ACCOUNTS} busiest "
            "accounts (whole fleet).", ["account", "state"], registry=r)
        self.account_limit = Gauge(
            "agentd_account_limit", f"The limits of the {TOP_ACCOUNTS} busiest accounts (theirs "
            "or the fleet's default): alert when runs approach them.", ["account", "limit"],
            registry=r)
        self.attached_devices = Gauge(
            "agentd_attached_devices", "Devices attached to a conversation right now "
            "(whole fleet).", registry=r)
        # This process, read at each scrape.
        self.in_flight = Gauge("agentd_in_flight", "Turns this process is executing.",
                               registry=r)
        self.pool_size = Gauge("agentd_pool_size",
                               "Database connections open in this process's pool.", registry=r)
        self.hub_connected = Gauge("agentd_hub_connected",
                                   "Whether the LISTEN connection is up.", registry=r)
        self.hub_subscribers = Gauge(
            "agentd_hub_subscribers", "In-process subscriptions (tails, waiters, watchers).",
            registry=r)
        self.connections_open = Gauge("agentd_connections_open",
                                      "HTTP connections open to this process.", registry=r)
        self.streams_open = Gauge("agentd_streams_open", "SSE streams open on this process.",
                                  registry=r)
        self._totals = _Totals()
        r.register(self._totals)

    def read_at_scrape(self, gauge: Gauge, read: Callable[[], float]) -> None:
        """`gauge` shows what `read` returns when scraped (a figure another object keeps)."""
        gauge.set_function(read)

    def total_at_scrape(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A counter `<name>_total` whose value another object keeps (e.g. the hub's)."""
        self._totals.sources[name] = (documentation, read)


class _Totals(Collector):
    """Counters kept as plain numbers by objects that know nothing of Prometheus (the hub),
    read when scraped."""

    def __init__(self) -> None:
        self.sources: dict[str, tuple[str, Callable[[], float]]] = {}

    def collect(self) -> Iterator[Metric]:
        for name, (documentation, read) in self.sources.items():
            yield CounterMetricFamily(name, documentation, value=read())
