"""The run lifecycle on PostgreSQL: enqueue, claim, heartbeat, fenced writes, finish, reap, stop.

Every function runs named statements from sql/queries.sql. Worker writes are fenced by
(run id, claim token, status running, unexpired deadline); a fenced-out write raises LeaseLost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar, cast
from uuid import UUID, uuid4

import asyncpg

from agentd.db import DB_ERRORS, Conn, acquire, fetch_one
from agentd.db import Db as Db  # re-exported: callers annotate with queue.Db
from agentd.group_commit import Batcher
from agentd.pgtext import clean, clean_text
from agentd.queries import Q
from agentd.vocabulary import Channel, EventType, MessageRole, MessageStatus, RunStatus

log = logging.getLogger("agentd.queue")

_I = TypeVar("_I")
_R = TypeVar("_R")


class LeaseLost(Exception):
    """This execution no longer owns its run: stop all work and write nothing more."""

    def __init__(self, run_id: UUID, action: str) -> None:
        super().__init__(f"run {run_id}: lease lost during {action}")
        self.run_id = run_id
        self.action = action


class SeqConflict(LeaseLost):
    """Another writer took one of our journal positions: a finalizer fenced us out, or (for a
    max+1 writer) an append committed between our snapshot and our lock; re-read and retry."""


class IdempotencyConflict(Exception):
    """The Idempotency-Key was already used for a run with a different request."""

    def __init__(self, run_id: UUID) -> None:
        super().__init__(f"idempotency key already used by run {run_id} with another request")
        self.run_id = run_id


class ConversationNotFound(LookupError):
    pass


class ModelChanged(Exception):
    """The conversation's model is no longer the one the post's request was built for (nothing
    was written): read the conversation and post again."""


# PostgreSQL fails an update with this internal error (SQLSTATE XX000, no code of its own) when
# the row's lock list still counts an update another transaction has just undone as in progress
# beside this one. The posts no longer undo such writes (sql/022), but any transaction that
# fails after updating a row others key-share-lock can still cause it. The failed statement
# wrote nothing.
_MULTIXACT_RACE = "new multixact has more than one updating member"


class AnswerLost(Exception):
    """A statement was sent and its answer never came (answer_in_doubt): it may have
    committed. `cause` is what asyncpg raised; a connection that could not be had at all, the
    statement unsent, is raised as itself."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause) or type(cause).__name__)
        self.cause = cause


async def _fetch_sent(db: Db, query: str, *args: Any) -> list[asyncpg.Record]:
    """db.fetch, raising AnswerLost when the statement went out and its answer was lost, and
    anything else as it came (a pool that cannot give a connection never sent it)."""
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            return await _fetch_sent(conn, query, *args)
    try:
        rows: list[asyncpg.Record] = await db.fetch(query, *args)
        return rows
    except Exception as exc:
        if answer_in_doubt(exc):
            raise AnswerLost(exc) from exc
        raise


def answer_in_doubt(exc: BaseException) -> bool:
    """Whether a statement may have committed though its answer never came: the connection
    broke (asyncpg reports that as a PostgresConnectionError), or the wait for the answer gave
    up. Any other error PostgreSQL answered with means the statement rolled back."""
    return isinstance(exc, (OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
                            TimeoutError))




def _in_transaction(db: Db) -> bool:
    """Whether `db` is a connection inside its caller's transaction, which a failed statement
    has spoilt: running it again there fails whatever the first error was."""
    return isinstance(db, asyncpg.Connection) and db.is_in_transaction()


def lost_race(exc: BaseException) -> bool:
    """Whether a statement failed only for racing other transactions (a deadlock's victim, or
    the internal error above): it rolled back whole, and running it once more is safe."""
    if isinstance(exc, asyncpg.DeadlockDetectedError):
        return True
    return isinstance(exc, asyncpg.InternalServerError) and str(exc).startswith(_MULTIXACT_RACE)


class QueueFull(Exception):
    """The account already has as many turns queued as it may (nothing was written)."""

    def __init__(self, max_queued: int) -> None:
        super().__init__(f"the account already has {max_queued} turns queued")
        self.max_queued = max_queued


@dataclass(frozen=True, slots=True)
class EnqueuedRun:
    run_id: UUID
    status: RunStatus
    conversation_id: UUID
    created: bool  # False when an idempotency key returned an earlier run
    user_message_id: UUID | None = None  # the question it wrote (None for a replay)


@dataclass(frozen=True, slots=True)
class Claim:
    """What a worker holds after a claim: the fence it must present on every write."""

    run_id: UUID
    account_id: UUID
    conversation_id: UUID
    user_message_id: UUID
    origin_device_id: UUID | None
    request: dict[str, Any]
    claim_token: UUID
    fence: int
    worker_id: str
    lease_expires_at: datetime
    cancel_requested: bool
    last_seq: int
    created_at: datetime | None = None  # when it was enqueued (database clock)
    started_at: datetime | None = None  # when this claim started it (database clock)
    # What the model reads first (role, content, tool_calls, tool_call_id), when the claim read
    # it too: a claim beside its post (post_turn). None: the executor reads it (open_turn).
    transcript: tuple[Mapping[str, Any], ...] | None = None


@dataclass(frozen=True, slots=True)
class Beat:
    cancel_requested: bool
    lease_expires_at: datetime


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What a process says about itself with every beat (its row of the `worker` table)."""

    worker_id: str
    host: str
    pid: int
    listen: str | None = None
    version: str | None = None
    runs_in_flight: int = 0
    max_runs: int = 0
    loop_lag_ms: float = 0.0  # the worst since the previous beat
    pool_wait_ms: float = 0.0
    admitting: bool = True


@dataclass(frozen=True, slots=True)
class WorkerRow:
    """A process of the fleet as its last beat described it; live by the database clock."""

    id: str
    host: str
    pid: int
    listen: str | None
    version: str | None
    started_at: datetime
    last_beat_at: datetime
    expires_at: datetime
    runs_in_flight: int
    max_runs: int
    loop_lag_ms: float
    pool_wait_ms: float
    admitting: bool
    live: bool
    beat_age_s: float


@dataclass(frozen=True, slots=True)
class NewEvent:
    """A journal event to write. Every payload a worker journals passes here, so here it is
    made storable (pgtext.py): one tool result with a NUL must not fail its write, nor the
    writes of the other runs sharing its commit. The rows handed to this process's tails are
    built from it too, so they match what the journal holds."""

    seq: int
    type: EventType
    payload: dict[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "payload", clean(self.payload))


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    type: EventType
    payload: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Draft:
    run_id: UUID
    message_id: UUID
    content: str


@dataclass(frozen=True, slots=True)
class StopResult:
    cancelled: list[UUID]  # queued runs cancelled outright
    drafts: list[Draft]  # their text, handed back
    flagged: list[UUID]  # running runs asked to stop


@dataclass(frozen=True, slots=True)
class QueueStatus:
    """The whole fleet's queue, as `agentd status` and /metrics show it."""

    queued: int
    running: int
    expired: int  # running runs past their deadline, awaiting the reaper
    workers: list[str]  # workers holding live leases


@dataclass(frozen=True, slots=True)
class IdempotentRun:
    """The first run minted for an Idempotency-Key, and the digest of its request."""

    run_id: UUID
    status: RunStatus
    conversation_id: UUID
    request_hash: str


@dataclass(frozen=True, slots=True)
class Ending:
    """A run finalized by someone other than its worker (reaper, stop), to be journaled."""

    run_id: UUID
    account_id: UUID
    conversation_id: UUID
    claim_token: UUID | None
    status: RunStatus
    error: str | None
    draft_id: UUID | None = None  # a queued turn's text a stop handed back
    error_code: str | None = None


@dataclass(frozen=True, slots=True)
class Reaped:
    """A run the reaper finalized: enough for its log line and its metrics."""

    run_id: UUID
    worker_id: str | None
    started_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class RunEnding:
    """A run's status and, when it failed, its client-facing error and code."""

    status: RunStatus
    error: str | None
    error_code: str | None


def request_hash(conversation_id: UUID, content: str, request: dict[str, Any]) -> str:
    """Stable digest of a run request: same key + same payload means the same run."""
    canonical = json.dumps({"conversation_id": str(conversation_id), "content": content,
                            "request": request},
                           sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


DEFAULT_MAX_QUEUED = 1000  # an account's queued turns, when neither it nor settings say
DEFAULT_MAX_RUNNING = 16


@dataclass(frozen=True, slots=True)
class NewRun:
    """One turn to enqueue: its question and the request snapshot the worker will run."""

    conversation_id: UUID
    content: str
    request: dict[str, Any]
    idempotency_key: str | None = None


EnqueueOutcome = EnqueuedRun | QueueFull | ConversationNotFound | IdempotencyConflict


async def enqueue_runs(db: Db, *, account_id: UUID, runs: Sequence[NewRun],
                       device_id: UUID | None = None,
                       default_max_queued: int = DEFAULT_MAX_QUEUED) -> list[EnqueueOutcome]:
    """Enqueue several turns of one account in one statement (each a run, its message, journal
    seq 1-2 and a wake: a run is a row, docs/architecture.md); one outcome per turn, in order:
    the run, or the QueueFull / ConversationNotFound / IdempotencyConflict that refused it
    (nothing written for it). The turns are created in the order asked. The conversations'
    rows are locked first, in id order, and only those a turn was written into move in the
    list (updated_at). Every process's claim loop is woken: post_turn is the enqueue that
    claims beside itself."""
    digests = [request_hash(r.conversation_id, r.content, r.request) for r in runs]
    rows = await db.fetch(*Q.enqueue_runs.bind(
        account_id=account_id, conversation_ids=[r.conversation_id for r in runs],
        device_id=device_id, contents=[r.content for r in runs],
        requests=[json.dumps(r.request) for r in runs], request_hashes=digests,
        idempotency_keys=[r.idempotency_key for r in runs],
        default_max_queued=default_max_queued))
    return [await _outcome(db, account_id, row, ask, digest)
            for row, ask, digest in zip(rows, runs, digests, strict=True)]


async def _outcome(db: Db, account_id: UUID, row: asyncpg.Record, ask: NewRun,
                   digest: str) -> EnqueueOutcome:
    """What the enqueue statement's answer row says happened to one turn."""
    if not row["conversation"]:
        return ConversationNotFound(str(ask.conversation_id))
    if row["id"] is not None:
        return EnqueuedRun(row["id"], RunStatus(row["status"]), ask.conversation_id, True,
                           row["user_message_id"])
    if (replay := await _replay(db, account_id, ask, digest)) is not None:
        return replay  # a retried POST: its first run stands, full queue or not
    if row["slot"] is None:
        return QueueFull(row["max_queued"])
    # A slot is checked free under its lock before the insert, so only a writer that bypassed
    # take_queue_slots could have taken it: a bug, not a race to retry.
    raise RuntimeError(f"turn {row['n']} was not inserted and holds no replay")


async def _replay(db: Db, account_id: UUID, ask: NewRun,
                  digest: str) -> EnqueuedRun | IdempotencyConflict | None:
    """The first run of this turn's Idempotency-Key, if there is one."""
    if ask.idempotency_key is None:
        return None
    first = await find_run_by_idempotency_key(db, account_id, ask.idempotency_key)
    if first is None:
        return None
    if first.request_hash != digest:
        return IdempotencyConflict(first.run_id)
    return EnqueuedRun(first.run_id, first.status, first.conversation_id, False)


async def enqueue_run(db: Db, *, account_id: UUID, conversation_id: UUID, content: str,
                      request: dict[str, Any], device_id: UUID | None = None,
                      idempotency_key: str | None = None,
                      default_max_queued: int = DEFAULT_MAX_QUEUED) -> EnqueuedRun:
    """Enqueue one turn (enqueue_runs). Raises QueueFull (no turn written) when the account is
    at its queued limit, ConversationNotFound when the conversation is not the account's,
    IdempotencyConflict when the key was used for another request."""
    [outcome] = await enqueue_runs(
        db, account_id=account_id, device_id=device_id, default_max_queued=default_max_queued,
        runs=[NewRun(conversation_id, content, request, idempotency_key)])
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


@dataclass(frozen=True, slots=True)
class ClaimBeside:
    """Who claims a turn beside its enqueue, and on what terms (claim_runs' own parameters)."""

    worker_id: str
    lease_ttl_s: float
    default_max_running: int = DEFAULT_MAX_RUNNING
    # Gives the claimed run its token, so a claim whose answer is lost is found again
    # (claims_found_again). One per reservation: a key is never used by two claims.
    claim_key: UUID = dataclasses.field(default_factory=uuid4)


@dataclass(frozen=True, slots=True)
class ModelGuess:
    """The conversation's own model (None: it has none, default_model applies) that a post's
    request was built on without reading the conversation; the post checks it."""

    model: str | None


async def post_turn(db: Db, *, account_id: UUID, turn: NewRun, claim: ClaimBeside | None,
                    device_id: UUID | None = None,
                    default_max_queued: int = DEFAULT_MAX_QUEUED,
                    guess: ModelGuess | None = None) -> tuple[EnqueuedRun, Claim | None]:
    """Post one turn as a client's post does, in ONE statement (sql/019, sql/021), and with
    `claim` (a free slot of this process) start it in that commit when the fair claim can only
    pick it: written running at once into an empty line, else claimed beside its enqueue; a turn
    left queued wakes the claim loops. The claim holds only once committed: at once on the pool,
    else at the caller's commit. Raises as enqueue_run does, and ModelChanged when `guess` is
    not the conversation's model; unlike enqueue_run, a post refused so writes nothing at all."""
    digest = request_hash(turn.conversation_id, turn.content, turn.request)
    statement = Q.post_turn.bind(
        account_id=account_id, conversation_id=turn.conversation_id, device_id=device_id,
        content=turn.content, request=json.dumps(turn.request), request_hash=digest,
        idempotency_key=turn.idempotency_key, default_max_queued=default_max_queued,
        worker_id=claim.worker_id if claim else None,
        lease_ttl_s=claim.lease_ttl_s if claim else None,
        default_max_running=claim.default_max_running if claim else None,
        model_guessed=guess is not None, guessed_model=guess.model if guess else None,
        claim_key=claim.claim_key if claim else None)
    try:
        [row] = await _fetch_sent(db, *statement)
    except AnswerLost as lost:
        if claim is None:  # nothing to find it by: as any lost answer
            raise lost.cause from None
        raise  # the caller looks for the turn by its claim's key (claims_found_again)
    if row["model_changed"]:
        raise ModelChanged(str(turn.conversation_id))
    outcome = await _outcome(db, account_id, row, turn, digest)
    if isinstance(outcome, Exception):
        raise outcome
    if row["claim_token"] is None:
        return outcome, None
    return outcome, Claim(
        run_id=row["id"], account_id=account_id, conversation_id=turn.conversation_id,
        user_message_id=row["user_message_id"], origin_device_id=device_id,
        request=turn.request, claim_token=row["claim_token"], fence=row["fence"],
        worker_id=row["worker_id"], lease_expires_at=row["lease_expires_at"],
        cancel_requested=row["cancel_requested"], last_seq=row["last_seq"],
        created_at=row["created_at"], started_at=row["started_at"],
        transcript=tuple(row["transcript"]))


async def find_run_by_idempotency_key(db: Db, account_id: UUID,
                                      idempotency_key: str) -> IdempotentRun | None:
    row = await db.fetchrow(*Q.find_run_by_idempotency_key.bind(
        account_id=account_id, idempotency_key=idempotency_key))
    if row is None:
        return None
    return IdempotentRun(row["id"], RunStatus(row["status"]), row["conversation_id"],
                         row["request_hash"])


def _claim_from_row(row: asyncpg.Record) -> Claim:
    return Claim(
        run_id=row["id"], account_id=row["account_id"], conversation_id=row["conversation_id"],
        user_message_id=row["user_message_id"], origin_device_id=row["origin_device_id"],
        request=row["request"] or {}, claim_token=row["claim_token"], fence=row["fence"],
        worker_id=row["worker_id"], lease_expires_at=row["lease_expires_at"],
        cancel_requested=row["cancel_requested"], last_seq=row["last_seq"] or 0,
        created_at=row["created_at"], started_at=row["started_at"])


Hint = Callable[[Channel, str], None]


async def announce_landed(db: Db, run_id: UUID, hint: Hint | None,
                          journaled: Callable[[UUID, Journaled], None] | None) -> None:
    """For journal rows whose append's answer was lost, found landed after all: what their
    append would have said once committed (tails here and elsewhere learn of them now, not at
    their next poll). Their rows are not at hand: readers read the database."""
    if journaled is not None:
        journaled(run_id, ())
    await _send_hints(db, hint, [(Channel.RUN_EVENT, str(run_id))])


async def _send_hints(db: Db, hint: Hint | None, hints: Sequence[tuple[Channel, str]]) -> None:
    """After a commit: hand wake hints to the process's notifier, or send them right away."""
    if hint is not None:
        for channel, payload in hints:
            hint(channel, payload)
    elif hints:
        await notify_batch(db, hints)


async def notify_batch(db: Db, hints: Sequence[tuple[Channel, str]], *,
                       fleet_wakes: bool = True) -> list[tuple[Channel, str]]:
    """Send wake hints in one statement: for rows already committed, or, inside the transaction
    that wrote them, to commit with them. A dispatchers' wake (RUN_ENQUEUED, from a turn's
    ending) is decided there: only while its conversation's account has a turn queued. Returns
    the hints sent; with `fleet_wakes` false, dispatchers' wakes are decided (and returned)
    but not sent, for the caller's own claim loop alone."""
    sent = await db.fetchval(*Q.notify_batch.bind(channels=[str(c) for c, _ in hints],
                                                  payloads=[p for _, p in hints],
                                                  fleet_wakes=fleet_wakes))
    return [hints[n - 1] for n in sent]


async def wake_claim_loops(db: Db, reason: str) -> None:
    """Wake every claim loop of the fleet (`reason` is the payload, for the log of a listener)."""
    await db.execute(*Q.wake_claim_loops.bind(reason=reason))


async def notify_conversation(db: Db, payload: str) -> None:
    """Wake a conversation's feeds (they re-read its rows)."""
    await db.execute(*Q.notify_conversation.bind(payload=payload))


async def claim_runs(db: Db, *, worker_id: str, lease_ttl_s: float, limit: int = 1,
                     default_max_running: int = DEFAULT_MAX_RUNNING,
                     hint: Hint | None = None) -> list[Claim]:
    """Claim up to `limit` runs in one statement (docs/architecture.md), fairly across accounts
    and within their running limits (at most one per account). It runs once more after
    losing a race; losing again to another claimer claims nothing, losing again to other
    transactions (lost_race) raises. Inside a caller's transaction nothing is run again: the
    failed statement spoilt it, and its owner decides.

    Should the answer be lost (the connection broke after the statement was sent), the runs it
    committed are looked for by its key on the pool and returned as if the answer had come
    (claims_found_again); when none are found or none can be, the error is raised."""
    rows: list[asyncpg.Record] = []
    key = uuid4()  # one per statement: the runs it claims get their tokens from it
    for attempt in range(2):
        try:
            # One statement commits whole or not at all. A unique violation means another
            # claimer won: the conversation (one_running_per_conversation, when a snapshot
            # fooled the pre-filter; require_conversation_lease, when a live execution holds
            # the lease) or a running slot it committed since our snapshot. Once more with a
            # fresh snapshot, then our runs stay queued for the next claim.
            rows = await _fetch_sent(db, *Q.claim_runs.bind(
                worker_id=worker_id, lease_ttl_s=lease_ttl_s, limit=limit,
                default_max_running=default_max_running, claim_key=key))
            break
        except asyncpg.UniqueViolationError:
            if _in_transaction(db):
                raise
            if attempt:
                return []
        except AnswerLost as lost:
            found = await claims_found_again(db, worker_id, key,
                                             within_s=lease_ttl_s * FIND_AGAIN_SHARE) \
                if isinstance(db, asyncpg.Pool) else None
            if not found:
                raise lost.cause from None
            log.warning("a claim's answer was lost; its runs were found by their key",
                        extra={"runs": len(found), "error": str(lost)})
            await _send_hints(db, hint, claim_hints(found))
            return found
        except asyncpg.PostgresError as exc:
            # A deadlock's victim or the multixact error wrote nothing either, and the turns it
            # wanted may well still be queued: once more at once, not a tick later.
            if attempt or not lost_race(exc) or _in_transaction(db):
                raise
    claims = [_claim_from_row(row) for row in rows]
    await _send_hints(db, hint, claim_hints(claims))
    return claims


# The share of a claim's lease spent looking for its runs after its answer was lost: what is
# found must still be held, and the heartbeat renew it, before the lease runs out.
FIND_AGAIN_SHARE = 1 / 3
_FIND_AGAIN_PAUSE_S = (0.1, 2.0)  # the pause between two reads, first and longest


async def claims_found_again(pool: asyncpg.Pool, worker_id: str, claim_key: UUID, *,
                             within_s: float) -> list[Claim] | None:
    """The runs a claim statement with `claim_key` committed, still running under `worker_id`
    (sql/023), for a claimer whose answer was lost. Read until a read answers, with a growing
    pause between reads, for at most `within_s` (the server may be restarting). None: no read
    answered in time, so nothing is known."""
    deadline = time.monotonic() + within_s
    pause, longest = _FIND_AGAIN_PAUSE_S
    while True:
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                rows = await pool.fetch(*Q.runs_claimed_with_key.bind(
                    worker_id=worker_id, claim_key=claim_key))
            return [_claim_from_row(row) for row in rows]
        except DB_ERRORS:
            if time.monotonic() + pause >= deadline:
                return None
        # A pause between attempts while the server is away, not a wait for a state.
        await asyncio.sleep(pause)
        pause = min(pause * 2, longest)


def claim_hints(claims: Sequence[Claim]) -> list[tuple[Channel, str]]:
    """What a committed claim announces: each run's tails wake for its run_started."""
    return [(Channel.RUN_EVENT, str(c.run_id)) for c in claims]


@dataclass(frozen=True, slots=True)
class BeatResult:
    """What one beat learned: renewed runs (with their cancel flags), runs it must retry
    because another transaction held their row, and runs that are no longer ours."""

    renewed: dict[UUID, Beat]
    busy: list[UUID]
    lost: list[UUID]


async def beat(db: Db, worker: WorkerReport, held: Sequence[Claim],
               lease_ttl_s: float) -> BeatResult:
    """One process's beat: renew every lease in `held` and the worker's own row, in ONE
    statement; rows locked elsewhere are skipped (`busy`), never waited for."""
    rows = await db.fetch(*Q.beat.bind(
        worker_id=worker.worker_id, host=worker.host, pid=worker.pid, listen=worker.listen,
        version=worker.version, lease_ttl_s=lease_ttl_s, runs_in_flight=worker.runs_in_flight,
        max_runs=worker.max_runs, loop_lag_ms=worker.loop_lag_ms,
        pool_wait_ms=worker.pool_wait_ms, admitting=worker.admitting,
        run_ids=[c.run_id for c in held], claim_tokens=[c.claim_token for c in held]))
    result = BeatResult({}, [], [])
    for row in rows:
        if row["outcome"] == "renewed":
            result.renewed[row["run_id"]] = Beat(row["cancel_requested"],
                                                 row["lease_expires_at"])
        elif row["outcome"] == "busy":
            result.busy.append(row["run_id"])
        else:
            result.lost.append(row["run_id"])
    return result


async def renew_leases_waiting(db: Db, held: Sequence[Claim],
                               lease_ttl_s: float) -> dict[UUID, Beat]:
    """Renew these leases, waiting for their row locks; a run missing from the answer is lost.
    Raises asyncpg.LockNotAvailableError when a lock is held past the session's lock_timeout."""
    rows = await db.fetch(*Q.renew_leases_waiting.bind(
        lease_ttl_s=lease_ttl_s, run_ids=[c.run_id for c in held],
        claim_tokens=[c.claim_token for c in held]))
    return {row["run_id"]: Beat(row["cancel_requested"], row["lease_expires_at"])
            for row in rows}


async def heartbeat(db: Db, claim: Claim, lease_ttl_s: float) -> Beat:
    """Renew one lease (a beat holding just this run, reported under the claim's worker id);
    raises LeaseLost when this execution no longer owns the run."""
    host, _, rest = claim.worker_id.partition(":")
    pid = rest.partition(":")[0]
    result = await beat(db, WorkerReport(claim.worker_id, host,
                                         int(pid) if pid.isdigit() else 0, runs_in_flight=1),
                        [claim], lease_ttl_s)
    renewed = result.renewed.get(claim.run_id)
    if renewed is None and result.busy:
        renewed = (await renew_leases_waiting(db, [claim], lease_ttl_s)).get(claim.run_id)
    if renewed is None:
        raise LeaseLost(claim.run_id, "heartbeat")
    return renewed


async def retire_worker(db: Db, worker_id: str) -> None:
    """A drained process leaves the fleet's list at once."""
    await db.execute(*Q.retire_worker.bind(worker_id=worker_id))


async def list_workers(db: Db) -> list[WorkerRow]:
    """The fleet's processes that beat recently, live ones first."""
    return [WorkerRow(**dict(row)) for row in await db.fetch(Q.list_workers.sql)]


async def purge_dead_workers(db: Db, *, older_than_s: float) -> int:
    result = await db.execute(*Q.purge_dead_workers.bind(older_than_s=older_than_s))
    return int(result.split()[-1])


async def check_lease(db: Db, claim: Claim) -> Beat:
    """Read-only: is the lease still ours and ahead? Raises LeaseLost if not (no renewal)."""
    row = await db.fetchrow(*Q.check_lease.bind(run_id=claim.run_id,
                                                claim_token=claim.claim_token))
    if row is None:
        raise LeaseLost(claim.run_id, "lease check")
    return Beat(row["cancel_requested"], row["lease_expires_at"])


async def open_turn(db: Db, claim: Claim) -> tuple[Beat, list[asyncpg.Record]]:
    """A turn's first read, in one round trip: the lease check (is it still ours and ahead?
    LeaseLost if not; no renewal) and the transcript the model sees (role, content,
    tool_calls, tool_call_id in turn order)."""
    rows: list[asyncpg.Record] = await db.fetch(*Q.open_turn.bind(
        run_id=claim.run_id, claim_token=claim.claim_token,
        conversation_id=claim.conversation_id, user_message_id=claim.user_message_id))
    if not rows:
        raise LeaseLost(claim.run_id, "lease check")
    return Beat(rows[0]["cancel_requested"], rows[0]["lease_expires_at"]), rows


async def append_events(db: Db, claim: Claim, events: Sequence[NewEvent], *,
                        hint: Hint | None = None) -> None:
    """Append a batch to the journal behind the fence, all or nothing (streams are tables:
    docs/architecture.md)."""
    if not events:
        return
    seqs = [e.seq for e in events]
    types = [str(e.type) for e in events]
    payloads = [json.dumps(e.payload, ensure_ascii=False) for e in events]
    try:
        row = await db.fetchrow(*Q.append_events_fenced.bind(
            run_id=claim.run_id, claim_token=claim.claim_token, seqs=seqs, types=types,
            payloads=payloads))
    except asyncpg.UniqueViolationError as exc:
        # Someone else wrote one of our seqs: only a finalizer does that, after fencing us out.
        raise SeqConflict(claim.run_id, "journal append") from exc
    if row is None or row["written"] != len(events):
        raise LeaseLost(claim.run_id, "journal append")
    await _send_hints(db, hint, [(Channel.RUN_EVENT, str(claim.run_id))])


async def insert_message(db: Db, claim: Claim, *, role: MessageRole, content: str,
                         status: MessageStatus = MessageStatus.COMPLETE,
                         tool_calls: list[dict[str, Any]] | None = None,
                         tool_call_id: str | None = None,
                         message_id: UUID | None = None) -> UUID:
    """Write a transcript message behind the fence; returns its id. The same `message_id`
    again (a retry after a lost answer) writes nothing more and returns it."""
    written = await db.fetchval(*Q.insert_message_fenced.bind(
        run_id=claim.run_id, claim_token=claim.claim_token, role=str(role),
        content=clean_text(content), status=str(status), tool_calls=clean(tool_calls),
        tool_call_id=None if tool_call_id is None else clean_text(tool_call_id),
        message_id=message_id or uuid4()))
    if written is None:
        raise LeaseLost(claim.run_id, "message write")
    return cast(UUID, written)


async def answer_open_tool_calls(db: Db, claim: Claim) -> int:
    """Behind the fence, give each tool call of the run still without a result a `cancelled`
    one (the same repair the reaper and stop apply); returns how many it answered."""
    answered = await db.fetchval(*Q.answer_open_tool_calls_fenced.bind(
        run_id=claim.run_id, claim_token=claim.claim_token))
    if answered is None:
        raise LeaseLost(claim.run_id, "tool-call repair")
    return int(answered)


@dataclass(frozen=True, slots=True)
class Finish:
    """A run's terminal write: its ending, its answer, and the last journal batch with it.

    `seq` is the complete event's position; None lets the database take max+1 (the
    dispatcher's backstop, which runs after the worker's task is gone)."""

    claim: Claim
    status: RunStatus
    seq: int | None
    last: Sequence[NewEvent] = ()
    content: str | None = None
    message_status: MessageStatus = MessageStatus.COMPLETE
    error: str | None = None
    error_code: str | None = None
    usage: dict[str, Any] | None = None


# The answer's message id (None: no text), or what refused or failed that run's write alone.
FinishOutcome = UUID | None | Exception
Finishes = Batcher["Finish", "UUID | None"]  # the process's shared terminal writes


async def ended_after_lost_answer(db: Db, claim: Claim, hint: Hint | None) -> RunEnding | None:
    """For a terminal write whose answer was lost on the wire and whose retry was refused: the
    run's ending if it has ended, by that first write (which did commit) or by a finalizer
    meanwhile, with the ending's wake hints sent (the lost answer kept them from going out;
    if a finalizer sent them too, a second wake costs a read); None if it has not ended."""
    ending = await run_status(db, claim.run_id)
    if ending is None or not ending.status.terminal:
        return None
    await _send_hints(db, hint, _finish_hints(claim))
    return ending


def _finish_hints(claim: Claim) -> list[tuple[Channel, str]]:
    """Who hears of an ending: the run's tails, the conversation's feeds, and the dispatchers
    (the conversation's next turn may start)."""
    conversation = str(claim.conversation_id)
    return [(Channel.RUN_EVENT, str(claim.run_id)), (Channel.RUN_ENQUEUED, conversation),
            (Channel.CONVERSATION, conversation)]


async def finish_runs(db: Db, finishes: Sequence[Finish]) -> list[FinishOutcome]:
    """Terminal writes of several runs in ONE statement and one commit, each behind its own
    fence; per run its outcome: the answer's message id, or the LeaseLost / SeqConflict (or
    another error of its own) its own terminal write would have raised. Sends no hints
    (callers do, once committed)."""
    for finish in finishes:
        if not finish.status.terminal:
            raise ValueError(f"{finish.status} is not a terminal status")
    events = [(f.claim.run_id, e) for f in finishes for e in f.last]
    try:
        rows = await db.fetch(*Q.finish_runs.bind(
            run_ids=[f.claim.run_id for f in finishes],
            claim_tokens=[f.claim.claim_token for f in finishes],
            statuses=[str(f.status) for f in finishes],
            errors=[None if f.error is None else clean_text(f.error) for f in finishes],
            error_codes=[f.error_code for f in finishes],
            usages=[None if f.usage is None else json.dumps(clean(f.usage)) for f in finishes],
            contents=[None if f.content is None else clean_text(f.content) for f in finishes],
            message_statuses=[str(f.message_status) for f in finishes],
            seqs=[f.seq for f in finishes], event_run_ids=[run for run, _ in events],
            event_seqs=[e.seq for _, e in events], event_types=[str(e.type) for _, e in events],
            event_payloads=[json.dumps(e.payload, ensure_ascii=False) for _, e in events]))
    except asyncpg.PostgresError as exc:
        if len(finishes) == 1 and isinstance(exc, asyncpg.UniqueViolationError):
            # Someone else wrote one of our seqs: a finalizer, after fencing us out (or, for
            # the backstop's max+1, an append that committed between snapshot and lock).
            return [SeqConflict(finishes[0].claim.run_id, "terminal write")]
        if not _written_alone_after(db, exc, len(finishes)):
            raise
        return await _each_alone(db, finishes, lambda f: _finish_alone(db, f))
    ended = {row["id"]: row["message_id"] for row in rows}
    return [ended[f.claim.run_id] if f.claim.run_id in ended
            else LeaseLost(f.claim.run_id, "terminal write") for f in finishes]


async def _finish_alone(db: Db, finish: Finish) -> FinishOutcome:
    [outcome] = await finish_runs(db, [finish])
    return outcome


async def finish_run(db: Db, claim: Claim, status: RunStatus, *, seq: int | None,
                     content: str | None = None,
                     message_status: MessageStatus = MessageStatus.COMPLETE,
                     error: str | None = None, error_code: str | None = None,
                     usage: dict[str, Any] | None = None,
                     hint: Hint | None = None) -> UUID | None:
    """The worker's terminal write, fenced; returns the answer's message id (None if no text).
    Raises LeaseLost (SeqConflict when its seq was taken) if it was refused."""
    return await finish_run_journaled(
        db, claim, status, last=(), seq=seq, content=content, message_status=message_status,
        error=error, error_code=error_code, usage=usage, hint=hint)


async def finish_run_journaled(db: Db, claim: Claim, status: RunStatus, *,
                               last: Sequence[NewEvent], seq: int | None,
                               content: str | None = None,
                               message_status: MessageStatus = MessageStatus.COMPLETE,
                               error: str | None = None, error_code: str | None = None,
                               usage: dict[str, Any] | None = None,
                               hint: Hint | None = None,
                               finishes: Finishes | None = None,
                               ) -> UUID | None:
    """The turn's last journal batch and its terminal write in ONE statement: one commit (one
    WAL flush) ends a turn instead of two, and either refused leaves both unwritten (LeaseLost /
    SeqConflict). With `finishes`, that statement is shared with other runs ending at the same
    time (group_commit.py). Hints go out only after the commit."""
    finish = Finish(claim, status, seq, tuple(last), content, message_status, error,
                    error_code, usage)
    if finishes is not None:
        outcome: FinishOutcome = await finishes.submit(finish)  # raises what refused it
    else:
        [outcome] = await finish_runs(db, [finish])
    if isinstance(outcome, Exception):
        raise outcome
    await _send_hints(db, hint, _finish_hints(claim))
    return outcome


JournalBatch = tuple[Claim, Sequence[NewEvent]]


Journaled = Sequence["Event"]  # the rows a journal batch became (empty: landed, rows unread)
Appends = Batcher[JournalBatch, Journaled]  # the process's shared journal writes


async def append_events_many(db: Db,
                             batches: Sequence[JournalBatch]) -> list[Journaled | Exception]:
    """Several runs' journal batches in one statement and one commit; per batch the rows it
    became (as a read would return them; empty when it was written alone), or the LeaseLost /
    SeqConflict (or another error of its own) its own append_events would have raised. Sends
    no hints (callers do, once committed)."""
    rows: list[tuple[UUID, UUID, int, str, str]] = [
        (claim.run_id, claim.claim_token, e.seq, str(e.type),
         json.dumps(e.payload, ensure_ascii=False))
        for claim, events in batches for e in events]
    try:
        found = await db.fetch(*Q.append_events_fenced_many.bind(
            run_ids=[r[0] for r in rows], claim_tokens=[r[1] for r in rows],
            seqs=[r[2] for r in rows], types=[r[3] for r in rows],
            payloads=[r[4] for r in rows]))
    except asyncpg.PostgresError as exc:
        if len(batches) == 1 and isinstance(exc, asyncpg.UniqueViolationError):
            # Someone took one of its seqs (a finalizer, after fencing it out).
            return [SeqConflict(batches[0][0].run_id, "journal append")]
        if not _written_alone_after(db, exc, len(batches)):
            raise
        return await _each_alone(db, batches, lambda batch: _append_alone(db, *batch))
    stamps: dict[UUID, dict[int, datetime]] = {}
    for row in found:
        stamps.setdefault(row["run_id"], {})[row["seq"]] = row["created_at"]
    outcomes: list[Journaled | Exception] = []
    for claim, events in batches:
        written = stamps.get(claim.run_id, {})
        if len(written) != len(events):
            outcomes.append(LeaseLost(claim.run_id, "journal append"))
        else:
            outcomes.append([Event(e.seq, e.type, e.payload, written[e.seq]) for e in events])
    return outcomes


async def _append_alone(db: Db, claim: Claim, events: Sequence[NewEvent]) -> Journaled:
    # No hint of its own: as after the shared statement, the caller sends one once told.
    await append_events(db, claim, events, hint=_no_hint)
    return ()  # landed; its rows are not at hand (the caller's tails read them)


def _no_hint(_channel: Channel, _payload: str) -> None:
    """A hint that goes nowhere (a caller sends it later)."""


# A shared statement that fails for what one of its runs brought wrote nothing, and is written
# again one run at a time so that only that run gets the error: a value PostgreSQL refuses
# (SQLSTATE class 22), a constraint (23), a value too large (54), or a row of one run that
# another transaction held past lock_timeout (55P03: a conversation being deleted, an
# operator's open transaction). Every run's writer would otherwise take that one row's wait for
# its own failure and stop its turn. Anything else says something about the database or the
# session, not one row (a lost connection, a statement timeout, a deadlock, a read-only
# server, a bug): each alone would fail the same way, so the batch fails whole and the writers
# retry it or give up as for one write.
_ONE_ROWS_FAULT = ("22", "23", "54", "55P03")
# Runs written alone at once after a shared statement failed: a run whose row is held waits
# out its own lock_timeout without holding up the others, and a batch of 64 does not ask the
# pool for 64 connections. As many waits in vain with none getting by say the lock is on more
# than one run's row (a table's, a migration's): the rest are not tried, each waiting as long.
_ALONE_AT_ONCE = 4


def _written_alone_after(db: Db, exc: asyncpg.PostgresError, runs: int) -> bool:
    """Whether a shared statement of `runs` runs that failed with `exc` (and so wrote nothing)
    is written again one run at a time: one of its runs may be to blame (see above; a seq
    someone took is one such), there are runs to tell apart, and no caller's transaction is
    spoilt (its owner decides)."""
    sqlstate = getattr(exc, "sqlstate", None) or ""
    return runs > 1 and sqlstate.startswith(_ONE_ROWS_FAULT) and not _in_transaction(db)


async def _each_alone(db: Db, items: Sequence[_I],
                      write: Callable[[_I], Awaitable[_R]]) -> list[_R | Exception]:
    """Write each item in its own statement and commit, each with its own outcome, in the
    items' order: one that fails (its own fault, a lock it waited for in vain, a connection
    dropped on it) leaves the others' answers their own. From a pool, a few at once (one
    connection cannot)."""
    at_once = asyncio.Semaphore(_ALONE_AT_ONCE if isinstance(db, asyncpg.Pool) else 1)
    passed = 0  # statements that did not wait for a lock in vain
    locked_out: list[asyncpg.LockNotAvailableError] = []

    async def one(item: _I) -> _R | Exception:
        nonlocal passed
        async with at_once:
            if len(locked_out) >= _ALONE_AT_ONCE and not passed:
                return locked_out[-1]  # not each run's own row (see _ALONE_AT_ONCE)
            outcome: _R | Exception
            try:
                outcome = await write(item)
            except Exception as exc:
                outcome = exc
            if isinstance(outcome, asyncpg.LockNotAvailableError):
                locked_out.append(outcome)
            else:
                passed += 1
            return outcome

    return list(await asyncio.gather(*(one(item) for item in items)))


async def append_events_batched(batcher: Appends, claim: Claim,
                                events: Sequence[NewEvent], *, hint: Hint | None = None,
                                journaled: Callable[[UUID, Journaled], None] | None = None,
                                ) -> None:
    """append_events in the next shared statement (group_commit.Batcher over
    append_events_many): the same fence, the same errors. After the commit, `journaled` (when
    given) is told the rows written, then the hint goes out. It is told even when they are not
    known (empty: the batch was written alone, rows unread), so that it lets go of the run's
    older rows: a tail woken by a "rows at hand" hint then reads the database instead of
    finding nothing newer held and sending nothing (shared_reads.py)."""
    if not events:
        return
    rows = await batcher.submit((claim, events))
    if journaled is not None:
        journaled(claim.run_id, rows)
    await _send_hints(batcher.db, hint, [(Channel.RUN_EVENT, str(claim.run_id))])


async def journal_endings(conn: Conn, endings: Sequence[Ending]) -> None:
    """Journal 'complete' for runs another party just finalized, in the caller's transaction."""
    if not endings:
        return
    await conn.execute(*Q.journal_endings.bind(
        run_ids=[e.run_id for e in endings], account_ids=[e.account_id for e in endings],
        conversation_ids=[e.conversation_id for e in endings],
        claim_tokens=[e.claim_token for e in endings],
        statuses=[str(e.status) for e in endings], errors=[e.error for e in endings],
        draft_ids=[e.draft_id for e in endings], error_codes=[e.error_code for e in endings]))


def _ending(row: asyncpg.Record) -> Ending:
    return Ending(row["id"], row["account_id"], row["conversation_id"], row["claim_token"],
                  RunStatus(row["status"]), row["error"], error_code=row["error_code"])


async def reap_expired_runs(pool: Db, *, grace_s: float = 0.0,
                            limit: int = 100) -> list[Reaped]:
    """Finalize runs whose lease passed (re-checked in the write) as failed; never re-queue."""
    async with acquire(pool) as conn, conn.transaction():
        rows = await conn.fetch(*Q.reap_expired_runs.bind(grace_s=grace_s, limit=limit))
        await journal_endings(conn, [_ending(row) for row in rows])
    return [Reaped(row["id"], row["worker_id"], row["started_at"], row["finished_at"])
            for row in rows]


async def reap_expired(pool: Db, *, grace_s: float = 0.0, limit: int = 100) -> list[UUID]:
    """reap_expired_runs, answering only the run ids."""
    return [r.run_id for r in await reap_expired_runs(pool, grace_s=grace_s, limit=limit)]


async def release_lease(db: Db, *, account_id: UUID, conversation_id: UUID,
                        execution_id: UUID) -> bool:
    """Delete the conversation lease only if this execution still holds it: a later
    execution's lease is never released by an earlier one (docs/architecture.md)."""
    return await db.fetchval(*Q.release_lease.bind(
        account_id=account_id, conversation_id=conversation_id,
        execution_id=execution_id)) is not None


async def stop_conversation(pool: Db, *, account_id: UUID, conversation_id: UUID,
                            run_ids: Sequence[UUID] | None = None,
                            queued_only: bool = False) -> StopResult:
    """Stop a conversation in ONE transaction (stop is a state: docs/architecture.md), or only
    `run_ids` of it.

    Queued turns are cancelled outright and their text handed back as drafts; the running one is
    flagged and woken (unless `queued_only`: a turn picked as queued that has started since is
    left alone); its worker finalizes it 'cancelled'.
    """
    async with acquire(pool) as conn, conn.transaction():
        # The conversation row first: a turn enqueued concurrently either commits before the
        # sweep (and is swept) or is created after it (and runs): never half-seen.
        await conn.fetchval(*Q.lock_conversation.bind(conversation_id=conversation_id,
                                                      account_id=account_id))
        locked = await conn.fetch(*Q.lock_active_runs.bind(conversation_id=conversation_id,
                                                           account_id=account_id))
        if run_ids is not None:
            wanted = set(run_ids)
            locked = [row for row in locked if row["id"] in wanted]
        queued = [row["id"] for row in locked if row["status"] == RunStatus.QUEUED]
        running = [] if queued_only else [row["id"] for row in locked
                                          if row["status"] == RunStatus.RUNNING]
        cancelled = await conn.fetch(*Q.cancel_queued_runs.bind(run_ids=queued)) \
            if queued else []
        await journal_endings(conn, [dataclasses.replace(_ending(row),
                                                         draft_id=row["message_id"])
                                     for row in cancelled])
        flagged = await conn.fetch(*Q.request_cancel.bind(run_ids=running)) if running else []
        if cancelled or flagged:
            await notify_conversation(conn, str(conversation_id))
    return StopResult(
        cancelled=[row["id"] for row in cancelled],
        drafts=[Draft(row["id"], row["message_id"], row["content"]) for row in cancelled],
        flagged=[row["id"] for row in flagged])


async def delete_conversation(pool: Db, *, account_id: UUID, conversation_id: UUID) -> bool:
    """Stop the conversation as a stop does, then remove it and everything of it, in ONE
    transaction; False when there is no such conversation (or it is already gone).

    The conversation row is locked first (as enqueue and stop take it): no turn is enqueued or
    claimed half-way, and a second delete waits, then finds nothing. A worker still running a
    turn finds its run gone at its next fenced write and stops (LeaseLost).
    """
    async with acquire(pool) as conn, conn.transaction():
        if await conn.fetchval(*Q.lock_conversation.bind(
                conversation_id=conversation_id, account_id=account_id)) is None:
            return False
        await stop_conversation(conn, account_id=account_id, conversation_id=conversation_id)
        return await conn.fetchval(*Q.delete_conversation.bind(
            conversation_id=conversation_id, account_id=account_id)) is not None


async def read_events(db: Db, run_id: UUID, *, after_seq: int = 0,
                      limit: int = 1000) -> list[Event]:
    """Journal rows after a cursor, in seq order."""
    rows = await db.fetch(*Q.read_events_after.bind(run_id=run_id, after_seq=after_seq,
                                                    limit=limit))
    return [Event(r["seq"], EventType(r["type"]), r["payload"], r["created_at"]) for r in rows]


async def read_events_many(db: Db, cursors: Sequence[tuple[UUID, int]],
                           limit: int = 1000) -> list[list[Event] | ValueError]:
    """read_events for several (run, cursor) pairs in one query; one list per pair, in order.

    A pair whose rows this version cannot read (an event type a newer agentd writes during a
    rolling deploy) gets the error in place of its list: one run's row spoils no other's read."""
    rows = await db.fetch(*Q.read_events_after_many.bind(
        run_ids=[run_id for run_id, _ in cursors], after_seqs=[seq for _, seq in cursors],
        limit=limit))
    out: list[list[Event] | ValueError] = [[] for _ in cursors]
    for r in rows:
        events = out[r["i"] - 1]
        if isinstance(events, ValueError):
            continue
        try:
            events.append(Event(r["seq"], EventType(r["type"]), r["payload"], r["created_at"]))
        except ValueError as exc:
            out[r["i"] - 1] = exc
    return out


async def run_status(db: Db, run_id: UUID) -> RunEnding | None:
    """A run's status and error, or None if there is no such run."""
    row = await db.fetchrow(*Q.run_status.bind(run_id=run_id))
    if row is None:
        return None
    return RunEnding(RunStatus(row["status"]), row["error"], row["error_code"])


async def queue_status(db: Db) -> QueueStatus:
    row = await fetch_one(db, Q.queue_status.sql)
    return QueueStatus(row["queued"], row["running"], row["expired"], list(row["workers"]))


@dataclass(frozen=True, slots=True)
class AccountQueue:
    """One account's turns now, with its own limits (None: the fleet's default)."""

    account: str
    queued: int
    running: int
    max_running: int | None
    max_queued: int | None


@dataclass(frozen=True, slots=True)
class RunningTurn:
    """A running conversation: who asked, which worker runs it, the lease left."""

    run_id: UUID
    conversation_id: UUID
    title: str
    account: str
    device: str | None
    worker_id: str
    started_at: datetime
    cancel_requested: bool
    lease_left_s: float


async def queue_by_account(db: Db, *, limit: int = 50) -> list[AccountQueue]:
    """The busiest accounts' queued and running turns."""
    return [AccountQueue(**dict(r)) for r in
            await db.fetch(*Q.queue_by_account.bind(limit=limit))]


async def running_turns(db: Db, *, limit: int = 200) -> list[RunningTurn]:
    """Every running turn of the fleet (oldest first): owner device, worker, lease left."""
    return [RunningTurn(**dict(r)) for r in await db.fetch(*Q.running_turns.bind(limit=limit))]


async def trim_journal(db: Db, *, older_than_s: float) -> int:
    """Retention: drop journal rows of long-terminal runs and null their request snapshots."""
    result = await db.execute(*Q.trim_journal.bind(older_than_s=older_than_s))
    return int(result.split()[-1])

