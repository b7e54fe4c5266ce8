"""The service layer: authorization and the multi-statement operations of the API.

HTTP handlers call only this module (and tail.py); it calls the queue SQL. Every method takes the
caller's Principal and scopes by its account first (authorize before competing,
docs/architecture.md): other accounts' objects are 404s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fnmatch
import logging
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol
from uuid import UUID

import asyncpg

from agentd import approvals, queue
from agentd import conversations as convs
from agentd.accounts import Principal
from agentd.conversation_models import ConversationModels
from agentd.db import Conn
from agentd.hub import Hub
from agentd.providers import ModelRef, parse_model, validate_params
from agentd.providers.base import UnknownModel
from agentd.providers.catalog import ModelRefused, check_usable
from agentd.settings import MAX_MODEL_NAME, Settings
from agentd.tools import ToolError, ToolRegistry
from agentd.vocabulary import (
    ACTIVE_RUN_STATUSES,
    ApprovalDecision,
    Channel,
    MessageRole,
    MessageStatus,
    RunStatus,
)

log = logging.getLogger("agentd.service")

IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,200}$")
LAST = "last"  # retry_of: the conversation's latest turn
# A full queue drains as turns finish; a client that waits this long finds room more often than
# not, and never hammers the daemon.
QUEUE_FULL_RETRY_AFTER_S = 10
TranscriptChanged = convs.TranscriptChanged  # an export's conversation deleted mid-way
EXPORT_PAGE = 500  # messages an export reads at a time (what it holds in memory, at most)
# A tool's full name: an MCP server's prefix, a dot and its name of at most 128 characters.
MAX_TOOL_NAME = 200


class ClaimSlot(Protocol):
    """A slot of this process held for a claim beside an enqueue, in the enqueue's statement."""

    @property
    def terms(self) -> queue.ClaimBeside:
        """Who claims, and on what terms: the dispatcher's own."""

    def settle(self, committed: Sequence[queue.Claim]) -> None:
        """Called once, whatever happened: start what committed, else give the slot back."""


class TurnStarter(Protocol):
    """Starts turns in the commit that enqueued them (dispatcher.Dispatcher)."""

    async def reserve(self) -> ClaimSlot | None:
        """A free slot now, or None (the turn then waits for the dispatcher's loop)."""


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
class RunAsk:
    """A create-run body, checked for shape; what it leaves out is decided with the database."""

    content: str | None  # None: a retry, re-sending the retried message's text
    model: ModelRef | None  # None: the conversation's model, else default_model
    params: dict[str, Any] | None  # None: {} (a retry: the retried run's params)
    on_busy: str
    retry_of: UUID | Literal["last"] | None = None


@dataclass(frozen=True, slots=True)
class RetryTool:
    """The tool a retry's run will name, and what checking it answered (None: usable), read
    before any lock or claim slot is held (Service._retry_tool)."""

    name: str | None
    refusal: ServiceError | None


def _retried_message(ask: RunAsk) -> UUID | None:
    """The message a retry names (None: the latest turn's)."""
    return ask.retry_of if isinstance(ask.retry_of, UUID) else None


@dataclass(frozen=True, slots=True)
class RunRequest:
    content: str
    model: ModelRef
    params: dict[str, Any]
    on_busy: str
    retry_of: UUID | None = None

    def snapshot(self) -> dict[str, Any]:
        """What the run row stores: all a worker needs, and what idempotency compares."""
        out = {"content": self.content, "model": str(self.model), "params": self.params}
        if self.retry_of is not None:
            out["retry_of"] = str(self.retry_of)
        return out


@dataclass(frozen=True, slots=True)
class ConversationChange:
    """A PATCH (or create) body: None means "not given"; `set_model` because None is a model."""

    title: str | None = None
    set_model: bool = False
    model: ModelRef | None = None
    archived: bool | None = None


@dataclass(frozen=True, slots=True)
class CreatedRun:
    run_id: UUID
    status: RunStatus
    conversation_id: UUID
    replayed: bool = False
    drafts: list[queue.Draft] = field(default_factory=list)
    user_message_id: UUID | None = None
    started: tuple[queue.Claim, ...] = ()  # claimed in the enqueue's commit (this run or another)


@dataclass(frozen=True, slots=True)
class MessagePaging:
    """`before` (a message id; None: the newest page), `limit`, and `until` (a message id the
    page must reach back to: a jump's target)."""

    before: UUID | None
    limit: int
    until: UUID | None = None


@dataclass(frozen=True, slots=True)
class FeedSnapshot:
    """Where a conversation feed starts, read in one snapshot so the parts agree."""

    state: convs.ConversationState  # its attached devices included
    watermark: tuple[datetime, UUID] | None  # the newest run; None when there is none yet


def parse_uuid(value: str, what: str) -> UUID:
    """Path ids that are not uuids name nothing: 404, like another account's ids."""
    try:
        return UUID(value)
    except (ValueError, AttributeError, TypeError):
        raise not_found(what) from None


def validate_model(value: Any, settings: Settings) -> ModelRef:
    """A model a request names: offered by a configured provider and usable now, or a 4xx."""
    if not isinstance(value, str):
        raise ServiceError(400, "invalid_model", "model must be a string like provider:model")
    if len(value) > MAX_MODEL_NAME:
        raise ServiceError(422, "invalid_model",
                           f"model names are at most {MAX_MODEL_NAME} characters")
    if not value.strip():
        raise ServiceError(422, "unknown_model", "model must name a model, like provider:model")
    return usable_model(value, settings)


def usable_model(name: str, settings: Settings) -> ModelRef:
    """The model `name` names, if it is on offer and can run now; else a 422 naming it."""
    try:
        model = parse_model(name, settings)
        check_usable(model, settings)
    except UnknownModel:
        raise ServiceError(422, "unknown_model", f"unknown model {name!r}: GET /v1/models "
                                                 f"lists the models on offer") from None
    except ModelRefused as exc:
        raise ServiceError(422, exc.code, exc.message, model=name) from None
    return model


class Service:
    def __init__(self, pool: asyncpg.Pool, hub: Hub, settings: Settings,
                 tools: ToolRegistry, starter: TurnStarter | None = None) -> None:
        self.pool = pool
        self.hub = hub
        self.settings = settings
        self.tools = tools
        self.starter = starter
        # What each conversation's model was when this process last read its row: a post that
        # names no model is built on it and checked by its own statement (conversation_models).
        self.models = ConversationModels()

    def _seen(self, who: Principal, conversation: convs.Conversation) -> convs.Conversation:
        self.models.seen(who.account_id, conversation.id, conversation.model)
        return conversation

    # conversations -------------------------------------------------------------------------

    async def create_conversation(self, who: Principal,
                                  change: ConversationChange) -> convs.Conversation:
        # A model the account may not use would make every post that names none a 403.
        if change.model is not None:
            _require_allowed(who, change.model)
        return self._seen(who, await convs.create_conversation(
            self.pool, who.account_id, change.title or "", _model_name(change.model)))

    async def list_conversations(self, who: Principal, limit: int = 100, *,
                                 archived: bool = False, after: convs.ListMark | None = None,
                                 ) -> tuple[list[convs.Conversation], convs.ListMark | None]:
        """A page of the list, and where the next one starts (None: this was the last)."""
        found = await convs.list_conversations(self.pool, who.account_id, limit + 1,
                                               archived=archived, after=after)
        if len(found) <= limit:
            return found, None
        last = found[limit - 1]
        return found[:limit], (last.updated_at, last.id)

    async def update_conversation(self, who: Principal, conversation_id: UUID,
                                  change: ConversationChange) -> convs.Conversation:
        """Rename, set or clear the model, archive or restore; the feeds show it live."""
        if change.model is not None:
            _require_allowed(who, change.model)
        updated = await convs.update_conversation(
            self.pool, who.account_id, conversation_id, title=change.title,
            set_model=change.set_model, model=_model_name(change.model),
            archived=change.archived)
        if updated is None:
            raise not_found("conversation")
        return self._seen(who, updated)

    async def delete_conversation(self, who: Principal, conversation_id: UUID) -> None:
        """Stop its turns as a stop does, then remove everything of it, in ONE transaction."""
        if not await queue.delete_conversation(self.pool, account_id=who.account_id,
                                               conversation_id=conversation_id):
            raise not_found("conversation")
        self.models.forget(who.account_id, conversation_id)

    async def fork_conversation(self, who: Principal, conversation_id: UUID,
                                message_id: UUID) -> tuple[convs.Conversation, int]:
        """A new conversation with the transcript up to `message_id`; (it, messages copied)."""
        row = await convs.fork_conversation(self.pool, who.account_id, conversation_id,
                                            message_id)
        if row is None:
            raise not_found("conversation")
        if not row["message_found"]:
            raise not_found("message")
        if row["id"] is None:
            raise ServiceError(409, "message_not_forkable",
                               f"message {message_id} belongs to a turn that has not ended (or "
                               f"was handed back as a draft): fork from an earlier message, "
                               f"or once the turn has ended", message_id=str(message_id))
        return self._seen(who, convs.Conversation.from_record(row)), row["copied"]

    async def search(self, who: Principal, query: str, limit: int = 50) -> list[asyncpg.Record]:
        """Messages (and titles) containing `query`, newest first, across the caller's account."""
        query = query.strip()
        if not query or len(query) > 200:
            raise ServiceError(400, "invalid_query", "q must be 1-200 characters")
        return await convs.search_messages(self.pool, who.account_id, query, limit)

    async def conversation_state(self, who: Principal, conversation_id: UUID,
                                 db: queue.Db | None = None, *,
                                 limit: int | None = None) -> convs.ConversationState:
        """The server's authority on a conversation, read from ONE snapshot (a run listed has
        its question in the transcript, an answer is never beside its run still running)."""
        if db is None:
            async with self.pool.acquire() as conn, conn.transaction(
                    isolation="repeatable_read", readonly=True):
                return await self.conversation_state(who, conversation_id, conn, limit=limit)
        state = await convs.conversation_state(db, who.account_id, conversation_id,
                                               limit=limit)
        if state is None:
            raise not_found("conversation")
        self._seen(who, state.conversation)
        return state

    async def message_page(self, who: Principal, conversation_id: UUID, page: MessagePaging,
                           ) -> convs.MessagePage:
        """One page of the transcript, older than the `before` cursor (newest pages first)."""
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read",
                                                                 readonly=True):
            try:
                found = await convs.message_page(conn, who.account_id, conversation_id,
                                                 before=page.before, limit=page.limit,
                                                 until=page.until)
            except convs.UnknownCursor as exc:
                name = exc.args[0]
                raise ServiceError(400, f"invalid_{name}",
                                   f"{name} must be the id of a message of this conversation"
                                   ) from None
        if found is None:
            raise not_found("conversation")
        return found

    async def get_conversation(self, who: Principal,
                               conversation_id: UUID) -> convs.Conversation:
        found = await convs.get_conversation(self.pool, who.account_id, conversation_id)
        if found is None:
            raise not_found("conversation")
        return found

    async def transcript_pages(self, who: Principal, conversation_id: UUID, *,
                               page_size: int = EXPORT_PAGE,
                               ) -> AsyncIterator[list[convs.Message]]:
        """The transcript in turn order, a page at a time, each read on a connection held
        only for that read (the caller writes a page out before it asks for the next). Its
        order is read first, whole (ids only); TranscriptChanged if the conversation is
        deleted meanwhile."""
        async with self.pool.acquire() as conn:
            ids = await convs.transcript_ids(conn, who.account_id, conversation_id)
            if not ids and await convs.get_conversation(conn, who.account_id,
                                                        conversation_id) is None:
                # Deleted since its heading was read: no order is not an empty transcript.
                raise TranscriptChanged(conversation_id)
        for start in range(0, len(ids), page_size):
            async with self.pool.acquire() as conn:
                page = await convs.messages_by_id(conn, conversation_id,
                                                  ids[start:start + page_size])
            yield page

    async def feed_snapshot(self, who: Principal, conversation_id: UUID, *,
                            limit: int | None = None) -> FeedSnapshot:
        """Transcript (its newest page, given a limit), runs, lease, watermark and attached
        devices from ONE snapshot."""
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read",
                                                                 readonly=True):
            state = await self.conversation_state(who, conversation_id, db=conn, limit=limit)
            watermark = await convs.latest_run(conn, conversation_id)
        return FeedSnapshot(state, watermark)

    # runs -----------------------------------------------------------------------------------

    def _request(self, ask: RunAsk, model: ModelRef, content: str,
                 params: dict[str, Any] | None, retry_of: UUID | None = None) -> RunRequest:
        """The run as it will be stored, its params checked for the model it runs on."""
        params = {} if params is None else params
        try:
            validate_params(self.settings.providers[model.provider], params,
                            max_run_s=self.settings.max_run_s)
        except ValueError as exc:
            raise ServiceError(422, "invalid_params", str(exc)) from None
        return RunRequest(content, model, params, ask.on_busy, retry_of)

    def _conversation_model(self, model: str | None) -> ModelRef:
        """A run that names no model gets its conversation's `model`, else default_model;
        usable now."""
        return usable_model(model or self.settings.default_model, self.settings)

    async def create_run(self, who: Principal, conversation_id: UUID, ask: RunAsk,
                         idempotency_key: str | None) -> CreatedRun:
        """Enqueue a turn; on_busy decides what happens when the conversation is not idle.

        With a slot free in this process, the enqueue's transaction also claims (the same fair
        claim the dispatcher makes), so a turn posted to an idle daemon starts in the commit that
        wrote it: docs/architecture.md, "Claim beside the enqueue"."""
        conversation = str(conversation_id)
        # The enqueue's own NOTIFYs come back to this process too, often before its answer is
        # read; the hints below wake this process's subscribers instead, so those echoes are
        # dropped (a claim loop woken for nothing claims nothing; a feed reads everything twice).
        forget = {channel: self.hub.expect_echo(channel, conversation)
                  for channel in (Channel.RUN_ENQUEUED, Channel.CONVERSATION)}
        try:
            created = await self._create_run_once(who, conversation_id, ask, idempotency_key)
        except BaseException:
            for echo in forget.values():  # nothing committed, or nobody is left to hint
                echo()
            raise
        if created.replayed:
            for echo in forget.values():  # a replay writes nothing and sends nothing
                echo()
            return created
        # Committed: this process's claim loop and the conversation's feeds here start now, not
        # when the enqueue's own NOTIFY has come back from PostgreSQL. A turn already started
        # beside its enqueue needs no claim, and no claim loop was woken for it (_claim_beside).
        if created.status == RunStatus.QUEUED:
            self.hub.hint_locally(Channel.RUN_ENQUEUED, conversation, echo=False)
        else:
            forget[Channel.RUN_ENQUEUED]()  # no echo of a wake that was never sent
        self.hub.hint_locally(Channel.CONVERSATION, conversation, echo=False)
        return created

    async def _create_run_once(self, who: Principal, conversation_id: UUID, ask: RunAsk,
                               idempotency_key: str | None) -> CreatedRun:
        """With a claim beside the enqueue when a slot is free. Should the post lose a race
        with other transactions (a deadlock's victim, none known to remain:
        docs/architecture.md; or PostgreSQL's internal multixact error: queue.lost_race), it
        rolled back whole and nothing was written, so it runs again without a claim beside
        it: three attempts in all. The third attempt's loss reaches the client as any request's
        lost race does, a 503 to retry (api/errors.py)."""
        # Before a claim slot is held: a tool's MCP server may take start_timeout_s to start,
        # and a slot held that long is one no other post here can start beside. A retry refuses
        # an unavailable tool only after its replay and its 409s (_retry), so it keeps the
        # answer for then.
        if idempotency_key is not None and not IDEMPOTENCY_KEY.match(idempotency_key):
            raise ServiceError(400, "invalid_idempotency_key",
                               "Idempotency-Key must be 1-200 printable ASCII characters")
        early = None
        if ask.retry_of is not None:
            early = await self._retry_tool(who, conversation_id, ask)
        elif isinstance(tool := (ask.params or {}).get("tool"), str):
            # Authorized first (the retry's read does it too): nothing is started for another
            # account's conversation, or for none, which is a 404 whatever the tool.
            if await convs.get_conversation(self.pool, who.account_id, conversation_id) is None:
                raise not_found("conversation")
            try:
                await self._check_tool(tool)
            except ServiceError:
                # A repeat of a post that landed is its replay, the tool usable now or not.
                replay = await self._replay_by_key(who, conversation_id, ask, idempotency_key)
                if replay is None:
                    raise
                return replay
        slot = await self.starter.reserve() if self.starter is not None else None
        for beside in (slot, None):
            try:
                if beside is not None:
                    # The handler shields this call (api/routes.py), so a request that goes
                    # away cannot leave the slot unsettled: what committed starts, else it is
                    # given back.
                    return await self._create_run_settling(who, conversation_id, ask,
                                                           idempotency_key, beside, early)
                return await self._create_run(who, conversation_id, ask, idempotency_key, None,
                                              early)
            except asyncpg.PostgresError as exc:
                if not queue.lost_race(exc):
                    raise
                log.warning("a post lost a race with other transactions; nothing was written",
                            extra={"error": str(exc)})
        return await self._create_run(who, conversation_id, ask, idempotency_key, None, early)

    async def _create_run_settling(self, who: Principal, conversation_id: UUID, ask: RunAsk,
                                   idempotency_key: str | None, slot: ClaimSlot,
                                   early: RetryTool | None) -> CreatedRun:
        committed: Sequence[queue.Claim] = ()
        try:
            created = await self._create_run(who, conversation_id, ask, idempotency_key, slot,
                                             early)
            committed = created.started  # returned only once its transaction has committed
            return created
        except queue.AnswerLost as lost:
            # The post's statement went out and its answer never came: it may have committed,
            # its turn running under this process with nobody to execute it. Found by its
            # claim's key, it starts here and is the answer, as if the answer had come.
            terms = slot.terms
            committed = await queue.claims_found_again(
                self.pool, terms.worker_id, terms.claim_key,
                within_s=terms.lease_ttl_s * queue.FIND_AGAIN_SHARE) or ()
            if not committed:
                raise lost.cause from None  # nothing known: as any lost answer (503)
            turn = committed[0]  # the one turn this post's key can have claimed
            log.warning("a post's answer was lost; its turn was found by its claim's key",
                        extra={"run_id": str(turn.run_id)})
            return CreatedRun(turn.run_id, RunStatus.RUNNING, turn.conversation_id, False,
                              user_message_id=turn.user_message_id, started=tuple(committed))
        finally:
            slot.settle(committed)

    async def _create_run(self, who: Principal, conversation_id: UUID, ask: RunAsk,
                          idempotency_key: str | None, slot: ClaimSlot | None,
                          early: RetryTool | None) -> CreatedRun:
        if ask.retry_of is not None:
            assert early is not None  # _create_run_once read it before the slot
            return await self._retry(who, conversation_id, ask, idempotency_key, slot, early)
        try:
            return await self._create_new_run(who, conversation_id, ask, idempotency_key, slot)
        except ServiceError as refusal:
            if ask.model is not None or refusal.status >= 500:
                raise
            # A repeat that names no model ran, the first time, on its conversation's model of
            # that time: a model changed (or refused) since is no reason to refuse the replay.
            replay = await self._replay_by_key(who, conversation_id, ask, idempotency_key)
            if replay is None:
                raise
            return replay

    async def _create_new_run(self, who: Principal, conversation_id: UUID, ask: RunAsk,
                              idempotency_key: str | None,
                              slot: ClaimSlot | None) -> CreatedRun:
        req, guess = await self._request_for(who, conversation_id, ask, guessing=True)
        try:
            return await self._post(who, conversation_id, req, idempotency_key, slot, guess)
        except queue.ModelChanged:
            # Changed since this process saw it (by another process): nothing was written, and
            # the conversation's row decides now.
            self.models.forget(who.account_id, conversation_id)
            req, guess = await self._request_for(who, conversation_id, ask, guessing=False)
            return await self._post(who, conversation_id, req, idempotency_key, slot, guess)

    async def _request_for(self, who: Principal, conversation_id: UUID, ask: RunAsk, *,
                           guessing: bool) -> tuple[RunRequest, queue.ModelGuess | None]:
        """The run's request as it will be stored. One that names no model runs on its
        conversation's: with `guessing`, the one this process last saw the conversation with,
        which the post's own statement checks (conversation_models.py); else read now. A guess
        that the request would be refused on is not used: the row decides that."""
        assert ask.content is not None  # validate_run_request: only a retry may omit it
        if ask.model is not None:
            return self._request(ask, ask.model, ask.content, ask.params), None
        guess = self.models.guess(who.account_id, conversation_id) if guessing else None
        if guess is not None:
            try:
                req = self._request(ask, self._conversation_model(guess.model), ask.content,
                                    ask.params)
                if model_allowed(str(req.model), who.models):
                    return req, guess
            except ServiceError:
                pass
        conversation = await convs.get_conversation(self.pool, who.account_id, conversation_id)
        if conversation is None:
            raise not_found("conversation")
        self._seen(who, conversation)
        return self._request(ask, self._conversation_model(conversation.model), ask.content,
                             ask.params), None

    @contextlib.asynccontextmanager
    async def _posting(self, slot: ClaimSlot | None) -> AsyncIterator[Conn]:
        """A connection in a transaction that may post a turn with a claim beside it (`slot`):
        that claim holds once the COMMIT lands, so a COMMIT whose answer is lost is
        queue.AnswerLost, for the caller to look for the turn by its key. A connection that
        cannot be had, or a body that fails, is raised as itself (nothing committed)."""
        lost: queue.AnswerLost | None = None
        committed = False
        try:
            async with self.pool.acquire() as conn:
                transaction = conn.transaction()
                await transaction.start()
                try:
                    yield conn
                except BaseException:
                    with contextlib.suppress(Exception):  # a connection gone rolled it back
                        await transaction.rollback()
                    raise
                try:
                    await transaction.commit()
                except Exception as exc:
                    if slot is not None and queue.answer_in_doubt(exc):
                        lost = queue.AnswerLost(exc)
                        raise lost from exc
                    raise
                committed = True
        except Exception as exc:
            # The pool's release of a connection that broke in or after the COMMIT (its
            # rollback sent on a dead link) can fail too. What the caller must hear is what
            # became of the commit, or a turn that committed is left running with nobody to
            # execute it: the doubt about it, or that it landed.
            if lost is not None:
                raise lost from lost.__cause__
            if not committed:
                raise
            log.warning("a post committed, then its connection could not be given back",
                        extra={"error": str(exc) or type(exc).__name__})

    async def _post(self, who: Principal, conversation_id: UUID, req: RunRequest,
                    idempotency_key: str | None, slot: ClaimSlot | None,
                    guess: queue.ModelGuess | None) -> CreatedRun:
        if "tool" in req.params:
            await self._check_tool(req.params["tool"])
        if req.on_busy == "enqueue":
            # One statement, one round trip, with the claim beside it when a slot is held: it
            # locks the conversation row itself, checks the account, and lets the unique index
            # arbitrate the idempotency key.
            return await self._enqueue(self.pool, who, conversation_id, req, idempotency_key,
                                       beside=slot, guess=guess)
        async with self._posting(slot) as conn:
            locked = await convs.lock_conversation(conn, who.account_id, conversation_id)
            if locked is None:
                raise not_found("conversation")
            if guess is not None and locked.model != guess.model:
                # Checked here, before the replay compares requests and before a stop, not
                # left to the post's statement: nothing is written yet.
                raise queue.ModelChanged(str(conversation_id))
            if idempotency_key is not None:
                replay = await self._replay(conn, who, conversation_id, idempotency_key, req)
                if replay is not None:
                    return replay
            drafts: list[queue.Draft] = []
            if req.on_busy == "reject":
                active = await convs.list_active_runs(conn, conversation_id)
                if active:
                    owner = active[0]
                    meta = await convs.conversation_meta(conn, who.account_id, conversation_id)
                    assert meta is not None  # locked above
                    lease = meta.lease
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
            created = await self._enqueue(conn, who, conversation_id, req, idempotency_key,
                                          beside=slot)  # the guess held when locked: it stands
        return dataclasses.replace(created, drafts=drafts)

    async def _check_tool(self, name: str) -> None:
        """A run may name only a registered tool (an MCP one is looked up on its server, which
        starts it): a typo is a 422 now, not a failed tool call later."""
        if len(name) > MAX_TOOL_NAME:  # not looked up, nor echoed back
            raise ServiceError(422, "invalid_params",
                               f"params.tool: a tool name is at most {MAX_TOOL_NAME} characters")
        try:
            tool = await self.tools.find(name)
        except ToolError as exc:
            # Why a server is unavailable can name environment variables, paths or the server's
            # own words: that stays in the log (and `agentd doctor`); the client learns only
            # that the tool it named cannot be used now.
            log.warning("a run named a tool whose MCP server is unavailable",
                        extra={"tool": name[:200], "error": str(exc)})
            raise ServiceError(422, "tool_unavailable", _unavailable_tool(name),
                               tool=name) from None
        if tool is None:
            raise ServiceError(422, "invalid_params", f"params.tool: no tool named {name!r}")

    async def _retry(self, who: Principal, conversation_id: UUID, ask: RunAsk,
                     idempotency_key: str | None, slot: ClaimSlot | None,
                     early: RetryTool) -> CreatedRun:
        """Re-run (or edit and re-run) the latest turn: a new run, in ONE transaction with the
        mark that supersedes the old exchange (kept in the transcript, hidden from the model).

        Naming the message makes it a compare-and-set: two devices retrying the same turn get
        one new run and one 409, and a client that has not seen a newer turn cannot replace it.
        """
        named = _retried_message(ask)
        async with self._posting(slot) as conn:
            locked = await convs.lock_conversation(conn, who.account_id, conversation_id)
            if locked is None:
                raise not_found("conversation")
            if idempotency_key is not None:
                replay = await self._replay_retry(conn, who, conversation_id, idempotency_key,
                                                  ask, named)
                if replay is not None:
                    return replay
            target = await convs.retry_target(conn, conversation_id, named)
            retried = _retry_target(target, named)
            model = ask.model if ask.model is not None else self._conversation_model(
                locked.model)
            inherited = ask.params is None
            params = (target["request"] or {}).get("params") if inherited else ask.params
            try:
                req = self._request(ask, model, ask.content or target["content"], params,
                                    retried)
            except ServiceError as exc:
                if inherited and exc.code == "invalid_params":
                    exc.message += " (the retried turn's params; send params to replace them)"
                raise
            tool = req.params.get("tool")
            if tool is not None and tool != early.name:
                # The latest turn changed between the early read and the lock (a turn posted
                # and ended meanwhile): rare enough to check its tool here, under the lock.
                await self._check_tool(tool)
            elif tool is not None and early.refusal is not None:
                raise early.refusal
            created = await self._enqueue(conn, who, conversation_id, req, idempotency_key,
                                          beside=slot)
            assert created.user_message_id is not None
            await convs.supersede_exchange(conn, conversation_id, retried,
                                           created.user_message_id)
            # A turn started beside the post came with the transcript its model reads, read
            # before this mark hid the retried exchange: its executor reads it again.
            return dataclasses.replace(created, started=tuple(
                dataclasses.replace(claim, transcript=None) for claim in created.started))

    async def _retry_tool(self, who: Principal, conversation_id: UUID,
                          ask: RunAsk) -> RetryTool:
        """The tool a retry's run will name (its own params, else the retried turn's), read
        without a lock and checked (which starts its MCP server) before the conversation's row
        is locked or a claim slot held: starting it can take start_timeout_s, and the
        conversation's stops, posts and deletes must not queue behind the lock meanwhile (they
        would answer 503). The locked read decides the retry."""
        params = ask.params
        if params is not None and not (isinstance(params, dict) and "tool" in params):
            return RetryTool(None, None)
        async with self.pool.acquire() as conn:
            # Authorized first: nothing is started for another account's conversation (a 404).
            if await convs.get_conversation(conn, who.account_id, conversation_id) is None:
                raise not_found("conversation")
            if params is None:
                target = await convs.retry_target(conn, conversation_id, _retried_message(ask))
                params = (target["request"] or {}).get("params") \
                    if target["id"] is not None else None
        tool = params.get("tool") if isinstance(params, dict) else None
        if not isinstance(tool, str):
            return RetryTool(None, None)
        try:
            await self._check_tool(tool)
        except ServiceError as refusal:
            return RetryTool(tool, refusal)
        return RetryTool(tool, None)

    async def _replay_retry(self, conn: Conn, who: Principal,
                            conversation_id: UUID, key: str, ask: RunAsk,
                            named: UUID | None) -> CreatedRun | None:
        """A retry repeated under its Idempotency-Key answers with the first run: what the
        repeat leaves out is taken from that run, then compared like any replay."""
        first = await queue.find_run_by_idempotency_key(conn, who.account_id, key)
        if first is None:
            return None
        run = await convs.get_run(conn, who.account_id, first.run_id)
        stored = (run.request if run is not None else None) or {}
        if "retry_of" not in stored:
            raise _idempotency_conflict(first.run_id)
        try:
            model = ask.model or parse_model(stored.get("model"), self.settings)
        except UnknownModel:
            raise _idempotency_conflict(first.run_id) from None
        req = RunRequest(
            ask.content if ask.content is not None else stored.get("content", ""), model,
            ask.params if ask.params is not None else stored.get("params", {}), ask.on_busy,
            named or UUID(stored["retry_of"]))
        return await self._replay(conn, who, conversation_id, key, req)

    async def _enqueue(self, db: queue.Db, who: Principal, conversation_id: UUID,
                       req: RunRequest, idempotency_key: str | None, *,
                       beside: ClaimSlot | None = None,
                       guess: queue.ModelGuess | None = None) -> CreatedRun:
        """Enqueue the turn in one statement that writes nothing if it refuses it
        (queue.post_turn). With `beside` (a slot of this process held for it), that statement
        claims it too when the fair claim picks it; the claim loops are woken only for a turn
        left queued: one started here needs none of them. What the claim started is `started`,
        valid once `db`'s transaction has committed. With `guess`, the request was built on
        that model of the conversation's, which the statement checks (queue.ModelChanged)."""
        _require_allowed(who, req.model)
        turn = queue.NewRun(conversation_id, req.content, req.snapshot(), idempotency_key)
        try:
            run, claim = await queue.post_turn(
                db, account_id=who.account_id, turn=turn,
                claim=beside.terms if beside is not None else None, device_id=who.device_id,
                default_max_queued=self.settings.account_max_queued, guess=guess)
        except queue.IdempotencyConflict as exc:
            raise _idempotency_conflict(exc.run_id) from None
        except queue.QueueFull as exc:
            raise ServiceError(429, "queue_full",
                               f"this account already has {exc.max_queued} turns queued; post "
                               "again once some have run", retry_after_s=QUEUE_FULL_RETRY_AFTER_S,
                               max_queued=exc.max_queued) from None
        except queue.ConversationNotFound:
            raise not_found("conversation") from None
        return CreatedRun(run.run_id, run.status, run.conversation_id, not run.created,
                          user_message_id=run.user_message_id,
                          started=() if claim is None else (claim,))

    async def _replay(self, conn: Conn, who: Principal, conversation_id: UUID,
                      key: str, req: RunRequest) -> CreatedRun | None:
        first = await queue.find_run_by_idempotency_key(conn, who.account_id, key)
        if first is None:
            return None
        if first.request_hash != queue.request_hash(conversation_id, req.content,
                                                    req.snapshot()):
            raise _idempotency_conflict(first.run_id)
        return CreatedRun(first.run_id, first.status, first.conversation_id, replayed=True)

    async def _replay_by_key(self, who: Principal, conversation_id: UUID, ask: RunAsk,
                             key: str | None) -> CreatedRun | None:
        """The first run of `key`, if `ask` is its request (with the model it ran on, when
        `ask` names none): read only when a post is refused, before or without its replay."""
        if key is None or ask.content is None:  # a retry replays in _replay_retry
            return None
        first = await queue.find_run_by_idempotency_key(self.pool, who.account_id, key)
        if first is None:
            return None
        run = await convs.get_run(self.pool, who.account_id, first.run_id)
        stored = ((run.request if run is not None else None) or {}).get("model")
        model = str(ask.model) if ask.model is not None else stored
        if not isinstance(model, str):
            return None
        request = {"content": ask.content, "model": model, "params": ask.params or {}}
        if first.request_hash != queue.request_hash(conversation_id, ask.content, request):
            return None
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

    async def cancel_run(self, who: Principal, run_id: UUID, *,
                         queued_only: bool = False) -> queue.StopResult:
        """Cancel one run; with `queued_only`, only while it is still queued (a client that
        picked a queued turn must not stop the answer it has become meanwhile)."""
        run = await self.get_run(who, run_id)
        return await queue.stop_conversation(self.pool, account_id=who.account_id,
                                             conversation_id=run.conversation_id,
                                             run_ids=[run_id], queued_only=queued_only)

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
                                              account_id=who.account_id,
                                              device_id=who.device_id)
        if not why.exists:
            raise ServiceError(404, "approval_not_found",
                               "this run has no tool approval with that call id")
        if why.decider_revoked:
            raise ServiceError(401, "device_revoked",
                               "this device's token was revoked; nothing was decided")
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

    async def attach(self, who: Principal, conversation_id: UUID, ttl_s: float) -> UUID | None:
        """Register the device as attached; None when the conversation is gone (deleted)."""
        try:
            return await convs.attach_presence(self.pool, who.account_id, conversation_id,
                                               who.device_id, ttl_s)
        except asyncpg.ForeignKeyViolationError:
            return None

    async def renew_presence(self, presence_id: UUID | None, ttl_s: float) -> bool:
        if presence_id is None:
            return False
        return await convs.renew_presence(self.pool, presence_id, ttl_s)

    async def detach(self, presence_id: UUID | None) -> None:
        if presence_id is not None:
            await convs.detach_presence(self.pool, presence_id)

    async def conversation_meta(self, who: Principal,
                                conversation_id: UUID) -> convs.ConversationMeta | None:
        """With its lease and attached devices; None once the conversation is gone: its feeds
        end."""
        meta = await convs.conversation_meta(self.pool, who.account_id, conversation_id)
        if meta is None:
            self.models.forget(who.account_id, conversation_id)
        else:
            self._seen(who, meta.conversation)
        return meta


def _unavailable_tool(name: str) -> str:
    """What a client reads when the tool it named cannot be used now: the tool and its server,
    both names it sent, and nothing of why (the log and `agentd doctor` say that)."""
    server = name.partition(".")[0]
    return (f"tool {name!r} is unavailable: its MCP server {server!r} could not be started or "
            f"reached; try again later (the daemon's log and `agentd doctor` say why)")


def _require_allowed(who: Principal, model: ModelRef) -> None:
    """403 model_not_allowed unless the account's model patterns allow `model`."""
    if not model_allowed(str(model), who.models):
        raise ServiceError(403, "model_not_allowed",
                           f"model {str(model)!r} is {NOT_ALLOWED} "
                           f"(allowed: {', '.join(who.models or ())})", model=str(model))


def _model_name(model: ModelRef | None) -> str | None:
    return None if model is None else str(model)


def _retry_target(row: asyncpg.Record, named: UUID | None) -> UUID:
    """The message a retry re-runs, or the 404 / 409 that says why there is none."""
    if row["id"] is None:
        if named is not None:
            raise not_found("message")
        raise ServiceError(409, "nothing_to_retry", "the conversation has no turn to retry")
    latest_active = row["latest_status"] == MessageStatus.QUEUED or \
        row["latest_run_status"] in ACTIVE_RUN_STATUSES
    if latest_active:
        raise ServiceError(409, "turn_active",
                           "the latest turn has not ended yet: stop it (or cancel it) first",
                           message_id=str(row["latest_id"]))
    if row["role"] != MessageRole.USER or row["superseded_by"] is not None or \
            row["status"] == MessageStatus.DRAFT or row["id"] != row["latest_id"]:
        raise ServiceError(409, "nothing_to_retry",
                           f"message {row['id']} is not the question of the conversation's "
                           f"latest turn; only that one can be retried or edited",
                           latest_message_id=str(row["latest_id"]) if row["latest_id"] else None)
    message_id: UUID = row["id"]
    return message_id


NOT_ALLOWED = "not allowed for this account"


def model_allowed(model: str, patterns: tuple[str, ...] | None) -> bool:
    """Whether an account whose model patterns are `patterns` (None: every model) may run
    `model` (`demo`, `openai:gpt-4o`); patterns are shell-style (`openai:*`, `local:smol*`)."""
    return patterns is None or any(fnmatch.fnmatchcase(model, p) for p in patterns)


def _idempotency_conflict(run_id: UUID) -> ServiceError:
    return ServiceError(409, "idempotency_conflict",
                        "this Idempotency-Key was already used with a different request",
                        run_id=str(run_id))
