"""The service layer: authorization and the multi-statement operations of the API.

HTTP handlers call only this module (and tail.py); it calls the queue SQL. Every method takes the
caller's Principal and scopes by its account first (rule 9): other accounts' objects are 404s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import asyncpg

from agentd import approvals, queue
from agentd import conversations as convs
from agentd.accounts import Principal
from agentd.hub import Hub
from agentd.providers import ModelRef
from agentd.settings import Settings
from agentd.tools import ToolError, ToolRegistry
from agentd.vocabulary import ApprovalDecision, Channel, RunStatus

IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,200}$")
# A full queue drains as turns finish; a client that waits this long finds room more often than
# not, and never hammers the daemon.
QUEUE_FULL_RETRY_AFTER_S = 10


class ServiceError(Exception):
    """An answer for the client: HTTP status, a stable code and a human message; a 429 or 503
    also says when to retry (Retry-After)."""

    def __init__(self, status: int, code: str, message: str, *,
                 retry_after_s: int | None = None, **details: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.details = details


def not_found(what: str) -> ServiceError:
    return ServiceError(404, "not_found", f"{what} not found")


@dataclass(frozen=True, slots=True)
class RunRequest:
    content: str
    model: ModelRef
    params: dict[str, Any]
    on_busy: str

    def snapshot(self) -> dict[str, Any]:
        """What the run row stores: all a worker needs, and what idempotency compares."""
        return {"content": self.content, "model": str(self.model), "params": self.params}


@dataclass(frozen=True, slots=True)
class CreatedRun:
    run_id: UUID
    status: RunStatus
    conversation_id: UUID
    replayed: bool = False
    drafts: list[queue.Draft] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FeedSnapshot:
    """Where a conversation feed starts, read in one snapshot so the parts agree."""

    state: convs.ConversationState
    watermark: tuple[datetime, UUID] | None  # the newest run; None when there is none yet
    attached: list[asyncpg.Record]


def parse_uuid(value: str, what: str) -> UUID:
    """Path ids that are not uuids name nothing: 404, like another account's ids."""
    try:
        return UUID(value)
    except (ValueError, AttributeError, TypeError):
        raise not_found(what) from None


class Service:
    def __init__(self, pool: asyncpg.Pool, hub: Hub, settings: Settings,
                 tools: ToolRegistry) -> None:
        self.pool = pool
        self.hub = hub
        self.settings = settings
        self.tools = tools

    # conversations -------------------------------------------------------------------------

    async def create_conversation(self, who: Principal, title: str) -> convs.Conversation:
        return await convs.create_conversation(self.pool, who.account_id, title)

    async def list_conversations(self, who: Principal,
                                 limit: int = 100) -> list[convs.Conversation]:
        return await convs.list_conversations(self.pool, who.account_id, limit)

    async def rename_conversation(self, who: Principal, conversation_id: UUID,
                                  title: str) -> convs.Conversation:
        renamed = await convs.rename_conversation(self.pool, who.account_id, conversation_id,
                                                  title)
        if renamed is None:
            raise not_found("conversation")
        return renamed

    async def search(self, who: Principal, query: str, limit: int = 50) -> list[asyncpg.Record]:
        """Messages (and titles) containing `query`, newest first, across the caller's account."""
        query = query.strip()
        if not query or len(query) > 200:
            raise ServiceError(400, "invalid_query", "q must be 1-200 characters")
        escaped = query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        return await convs.search_messages(self.pool, who.account_id, f"%{escaped}%", limit)

    async def conversation_state(self, who: Principal, conversation_id: UUID,
                                 db: queue.Db | None = None) -> convs.ConversationState:
        state = await convs.conversation_state(db or self.pool, who.account_id, conversation_id)
        if state is None:
            raise not_found("conversation")
        return state

    async def feed_snapshot(self, who: Principal, conversation_id: UUID) -> FeedSnapshot:
        """Transcript, runs, lease, watermark and attached devices from ONE snapshot."""
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read",
                                                                 readonly=True):
            state = await self.conversation_state(who, conversation_id, db=conn)
            watermark = await convs.latest_run(conn, conversation_id)
            attached = await self.attached(conversation_id, db=conn)
        return FeedSnapshot(state, watermark, attached)

    async def lease(self, who: Principal, conversation_id: UUID) -> convs.Lease | None:
        return await convs.get_lease(self.pool, who.account_id, conversation_id)

    async def attached(self, conversation_id: UUID,
                       db: queue.Db | None = None) -> list[asyncpg.Record]:
        return await convs.list_attached(db or self.pool, conversation_id)

    # runs -----------------------------------------------------------------------------------

    async def create_run(self, who: Principal, conversation_id: UUID, req: RunRequest,
                         idempotency_key: str | None) -> CreatedRun:
        """Enqueue a turn; on_busy decides what happens when the conversation is not idle."""
        if idempotency_key is not None and not IDEMPOTENCY_KEY.match(idempotency_key):
            raise ServiceError(400, "invalid_idempotency_key",
                               "Idempotency-Key must be 1-200 printable ASCII characters")
        if not model_allowed(str(req.model), who.models):
            raise ServiceError(403, "model_not_allowed",
                               f"model {str(req.model)!r} is not allowed for this account "
                               f"(allowed: {', '.join(who.models or ())})",
                               model=str(req.model))
        if "tool" in req.params:
            await self._check_tool(req.params["tool"])
        if req.on_busy == "enqueue":
            # One statement, one round trip: it locks the conversation row itself, checks the
            # account, and lets the unique index arbitrate the idempotency key.
            return await self._enqueue(self.pool, who, conversation_id, req, idempotency_key)
        async with self.pool.acquire() as conn, conn.transaction():
            if not await convs.lock_conversation(conn, who.account_id, conversation_id):
                raise not_found("conversation")
            if idempotency_key is not None:
                replay = await self._replay(conn, who, conversation_id, idempotency_key, req)
                if replay is not None:
                    return replay
            drafts: list[queue.Draft] = []
            if req.on_busy == "reject":
                active = await convs.list_active_runs(conn, conversation_id)
                if active:
                    owner = active[0]
                    lease = await convs.get_lease(conn, who.account_id, conversation_id)
                    raise ServiceError(
                        409, "conversation_busy",
                        f"the conversation is busy with run {owner.id} ({owner.status})",
                        run_id=str(owner.id), run_status=str(owner.status),
                        device=lease.device if lease else None,
                        worker_id=lease.worker_id if lease else None)
            elif req.on_busy == "interrupt":
                stopped = await queue.stop_conversation(conn, account_id=who.account_id,
                                                        conversation_id=conversation_id)
                drafts = stopped.drafts
            created = await self._enqueue(conn, who, conversation_id, req, idempotency_key)
        return dataclasses.replace(created, drafts=drafts)

    async def _check_tool(self, name: str) -> None:
        """A run may name only a registered tool (an MCP one is looked up on its server, which
        starts it): a typo is a 422 now, not a failed tool call later."""
        try:
            tool = await self.tools.find(name)
        except ToolError as exc:
            raise ServiceError(422, "tool_unavailable", str(exc)) from None
        if tool is None:
            raise ServiceError(422, "invalid_params", f"params.tool: no tool named {name!r}")

    async def _enqueue(self, db: queue.Db, who: Principal, conversation_id: UUID,
                       req: RunRequest, idempotency_key: str | None) -> CreatedRun:
        try:
            run = await queue.enqueue_run(
                db, account_id=who.account_id, conversation_id=conversation_id,
                content=req.content, request=req.snapshot(), device_id=who.device_id,
                idempotency_key=idempotency_key,
                default_max_queued=self.settings.account_max_queued)
        except queue.IdempotencyConflict as exc:
            raise _idempotency_conflict(exc.run_id) from None
        except queue.QueueFull as exc:
            raise ServiceError(429, "queue_full",
                               f"this account already has {exc.max_queued} turns queued; post "
                               "again once some have run", retry_after_s=QUEUE_FULL_RETRY_AFTER_S,
                               max_queued=exc.max_queued) from None
        except queue.ConversationNotFound:
            raise not_found("conversation") from None
        return CreatedRun(run.run_id, run.status, run.conversation_id, not run.created)

    async def _replay(self, conn: asyncpg.Connection, who: Principal, conversation_id: UUID,
                      key: str, req: RunRequest) -> CreatedRun | None:
        first = await queue.find_run_by_idempotency_key(conn, who.account_id, key)
        if first is None:
            return None
        if first.request_hash != queue.request_hash(conversation_id, req.content,
                                                    req.snapshot()):
            raise _idempotency_conflict(first.run_id)
        return CreatedRun(first.run_id, first.status, first.conversation_id, replayed=True)

    async def get_run(self, who: Principal, run_id: UUID) -> convs.RunRow:
        run = await convs.get_run(self.pool, who.account_id, run_id)
        if run is None:
            raise not_found("run")
        return run

    async def wait_run(self, who: Principal, run_id: UUID, timeout_s: float) -> convs.RunRow:
        """Block until the run is terminal or the timeout passes (NOTIFY-driven, poll-backed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self.hub.subscribe(Channel.RUN_EVENT, str(run_id)) as sub:
            while True:
                run = await self.get_run(who, run_id)
                left = deadline - loop.time()
                if run.status.terminal or left <= 0:
                    return run
                await sub.wait(min(left, 1.0 if not self.hub.connected else 5.0))

    async def cancel_run(self, who: Principal, run_id: UUID) -> queue.StopResult:
        run = await self.get_run(who, run_id)
        return await queue.stop_conversation(self.pool, account_id=who.account_id,
                                             conversation_id=run.conversation_id,
                                             run_ids=[run_id])

    async def stop_conversation(self, who: Principal,
                                conversation_id: UUID) -> queue.StopResult:
        if await convs.get_conversation(self.pool, who.account_id, conversation_id) is None:
            raise not_found("conversation")
        return await queue.stop_conversation(self.pool, account_id=who.account_id,
                                             conversation_id=conversation_id)

    # tool approvals -------------------------------------------------------------------------

    async def decide_approval(self, who: Principal, run_id: UUID, call_id: str,
                              decision: ApprovalDecision,
                              note: str | None) -> approvals.Decision:
        """Any device of the run's account decides a pending approval; the first decision wins
        (one fenced statement), a later one is a 409 naming who decided."""
        await self.get_run(who, run_id)  # another account's run: 404
        decided = await approvals.decide_approval(
            self.pool, run_id=run_id, call_id=call_id, account_id=who.account_id,
            device_id=who.device_id, decision=decision, note=note)
        if decided is not None:
            return decided
        why = await approvals.explain_refusal(self.pool, run_id=run_id, call_id=call_id,
                                              account_id=who.account_id)
        if not why.exists:
            raise ServiceError(404, "approval_not_found",
                               "this run has no tool approval with that call id")
        if why.decision is not None:
            earlier = why.decision
            if earlier.timed_out:
                message = "already denied: the approval timed out"
            else:
                verb = "approved" if earlier.decision == ApprovalDecision.APPROVE else "denied"
                message = f"already {verb} by {earlier.device or 'a device'}"
            raise ServiceError(409, "approval_already_decided", message,
                               decision=str(earlier.decision), device=earlier.device,
                               device_id=str(earlier.device_id) if earlier.device_id else None,
                               timed_out=earlier.timed_out,
                               decided_at=earlier.decided_at.astimezone(UTC).isoformat()
                               .replace("+00:00", "Z"))
        if why.expired:
            raise ServiceError(409, "approval_expired",
                               "the approval timed out; the call is being denied")
        raise ServiceError(409, "approval_not_pending",
                           "the run no longer waits for this approval (it was stopped or ended)")

    async def list_approvals(self, who: Principal, run_id: UUID) -> list[dict[str, Any]]:
        await self.get_run(who, run_id)
        return await approvals.list_approvals(self.pool, run_id, who.account_id)

    # presence -------------------------------------------------------------------------------

    async def attach(self, who: Principal, conversation_id: UUID, ttl_s: float) -> UUID:
        return await convs.attach_presence(self.pool, who.account_id, conversation_id,
                                           who.device_id, ttl_s)

    async def renew_presence(self, presence_id: UUID, ttl_s: float) -> bool:
        return await convs.renew_presence(self.pool, presence_id, ttl_s)

    async def detach(self, presence_id: UUID) -> None:
        await convs.detach_presence(self.pool, presence_id)


def model_allowed(model: str, patterns: tuple[str, ...] | None) -> bool:
    """Whether an account whose model patterns are `patterns` (None: every model) may run
    `model` (`demo`, `openai:gpt-4o`); patterns are shell-style (`openai:*`, `local:smol*`)."""
    return patterns is None or any(fnmatch.fnmatchcase(model, p) for p in patterns)


def _idempotency_conflict(run_id: UUID) -> ServiceError:
    return ServiceError(409, "idempotency_conflict",
                        "this Idempotency-Key was already used with a different request",
                        run_id=str(run_id))
