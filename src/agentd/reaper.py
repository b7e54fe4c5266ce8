"""The reaper: a loop in every process (no singleton) plus one sweep at boot (the reconciler).

It finalizes failed only runs whose lease has passed, re-checked inside the write (lease for
liveness, fence for correctness: docs/architecture.md), so a run whose heartbeat landed first
survives. It also trims the journal of long-finished runs.
"""

from __future__ import annotations

import asyncio
import logging

import asyncpg

from agentd.db import DB_ERRORS
from agentd.metrics import Metrics
from agentd.pairing import purge_pairings
from agentd.queue import purge_dead_workers, reap_expired_runs, trim_journal
from agentd.settings import Settings
from agentd.vocabulary import RunErrorCode, RunStatus

log = logging.getLogger("agentd.reaper")

TRIM_EVERY_N_SWEEPS = 120
PAIRING_AUDIT_S = 7 * 86_400.0  # spent and expired pairing codes are kept this long
DEAD_WORKER_ROWS_KEPT_S = 86_400.0  # `agentd status` can still name a worker that died today


async def sweep(pool: asyncpg.Pool, settings: Settings, metrics: Metrics | None = None) -> int:
    """Reap every expired run now; returns how many were finalized."""
    total = 0
    while True:
        reaped = await reap_expired_runs(pool, grace_s=settings.reap_grace_s, limit=100)
        for run in reaped:
            # The worker's id is for operators; clients see lease_expired and a short message.
            log.warning("reaped run whose lease expired", extra={
                "run_id": str(run.run_id), "worker_id": run.worker_id,
                "error_code": str(RunErrorCode.LEASE_EXPIRED)})
            if metrics is not None:
                metrics.reaped.inc()
                if run.started_at is not None and run.finished_at is not None:
                    metrics.run_seconds.labels(status=str(RunStatus.FAILED)).observe(
                        (run.finished_at - run.started_at).total_seconds())
        total += len(reaped)
        if len(reaped) < 100:
            return total


async def reap_forever(pool: asyncpg.Pool, settings: Settings,
                       metrics: Metrics | None = None) -> None:
    sweeps = 0
    while True:
        await asyncio.sleep(settings.reap_interval_s)
        try:
            await sweep(pool, settings, metrics)
            sweeps += 1
            if sweeps % TRIM_EVERY_N_SWEEPS == 0:
                trimmed = await trim_journal(pool, older_than_s=settings.journal_retention_s)
                if trimmed:
                    log.info("trimmed journal", extra={"rows": trimmed})
                await purge_pairings(pool, older_than_s=PAIRING_AUDIT_S)
                await purge_dead_workers(pool, older_than_s=DEAD_WORKER_ROWS_KEPT_S)
        except DB_ERRORS as exc:
            log.warning("reaper sweep failed; will retry", extra={"error": str(exc)})
