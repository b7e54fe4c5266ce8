"""`agentd status`: the fleet at a glance, read from the database only.

Live workers come from their heartbeats (the `worker` table), the queue from the per-account
counts, ownership from the running runs and their leases, all by the database clock; so any
machine that reaches the database sees the same picture. `--json` prints the same as one object.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime

from agentd.queue import (
    AccountQueue,
    Db,
    QueueStatus,
    RunningTurn,
    WorkerRow,
    list_workers,
    queue_by_account,
    queue_status,
    running_turns,
)
from agentd.settings import Settings

MAX_ACCOUNTS = 50
MAX_RUNNING_SHOWN = 200


@dataclass(frozen=True, slots=True)
class FleetStatus:
    queue: QueueStatus
    workers: list[WorkerRow]  # live ones (their beat deadline is ahead)
    accounts: list[AccountQueue]  # the busiest, with their limits (None: the default)
    running: list[RunningTurn]
    default_max_running: int
    default_max_queued: int


async def read_fleet_status(db: Db, settings: Settings) -> FleetStatus:
    return FleetStatus(
        queue=await queue_status(db),
        workers=[w for w in await list_workers(db) if w.live],
        accounts=await queue_by_account(db, limit=MAX_ACCOUNTS),
        running=await running_turns(db, limit=MAX_RUNNING_SHOWN),
        default_max_running=settings.account_max_running,
        default_max_queued=settings.account_max_queued)


def as_json(status: FleetStatus) -> str:
    """The status as one JSON object (a stable shape for scripts; times RFC 3339 UTC)."""
    queue = status.queue
    body = {
        "queue": {"queued": queue.queued, "running": queue.running,
                  "expired_leases": queue.expired},
        "workers": [{
            "worker_id": w.id, "host": w.host, "pid": w.pid, "listen": w.listen,
            "version": w.version, "started_at": _ts(w.started_at),
            "last_beat_at": _ts(w.last_beat_at), "beat_age_s": round(w.beat_age_s, 3),
            "runs_in_flight": w.runs_in_flight, "max_runs": w.max_runs,
            "loop_lag_ms": w.loop_lag_ms, "pool_wait_ms": w.pool_wait_ms,
            "claiming": w.admitting} for w in status.workers],
        "accounts": [{
            **asdict(a),
            "max_running": _limit(a.max_running, status.default_max_running),
            "max_queued": _limit(a.max_queued, status.default_max_queued)}
            for a in status.accounts],
        "running": [{
            "run_id": str(t.run_id), "conversation_id": str(t.conversation_id),
            "title": t.title, "account": t.account, "device": t.device,
            "worker_id": t.worker_id, "started_at": _ts(t.started_at),
            "lease_left_s": round(t.lease_left_s, 3),
            "cancel_requested": t.cancel_requested} for t in status.running],
    }
    return json.dumps(body, indent=2, ensure_ascii=False)


def as_text(status: FleetStatus) -> str:
    queue = status.queue
    lines = [f"queued: {queue.queued}   running: {queue.running}   "
             f"expired leases awaiting the reaper: {queue.expired}",
             "", f"live workers: {len(status.workers)}"]
    if status.workers:
        lines.append(f"  {'host':20} {'pid':>7} {'runs':>9} {'last beat':>11} "
                     f"{'loop lag':>9} {'pool wait':>9}  claiming")
        for w in status.workers:
            lines.append(
                f"  {w.host[:20]:20} {w.pid:>7} {f'{w.runs_in_flight}/{w.max_runs}':>9} "
                f"{f'{w.beat_age_s:.1f} s ago':>11} {f'{w.loop_lag_ms:.0f} ms':>9} "
                f"{f'{w.pool_wait_ms:.0f} ms':>9}  {'yes' if w.admitting else 'holding back'}")
    lines += ["", f"accounts with turns: {len(status.accounts)}"]
    if status.accounts:
        lines.append(f"  {'account':24} {'queued':>14} {'running':>12}")
        for a in status.accounts:
            queued = f"{a.queued}/{_limit(a.max_queued, status.default_max_queued)}"
            running = f"{a.running}/{_limit(a.max_running, status.default_max_running)}"
            lines.append(f"  {a.account[:24]:24} {queued:>14} {running:>12}")
    lines += ["", f"running conversations: {len(status.running)}"]
    if status.running:
        lines.append(f"  {'conversation':36} {'account':12} {'asked from':14} "
                     f"{'worker':28} lease left")
        for t in status.running:
            lease = f"{t.lease_left_s:.1f} s" if t.lease_left_s > 0 else "expired"
            stop = " (stopping)" if t.cancel_requested else ""
            lines.append(f"  {t.conversation_id!s:36} {t.account[:12]:12} "
                         f"{(t.device or '-')[:14]:14} {t.worker_id[:28]:28} {lease}{stop}")
    return "\n".join(lines)


def _limit(own: int | None, default: int) -> int:
    return default if own is None else own


def _ts(value: datetime | None) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value is not None else None
