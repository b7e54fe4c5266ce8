"""The ToolStore tools run against: each operation a tool may perform, on the daemon's pool."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from datetime import datetime
from typing import TypeVar
from uuid import UUID

import asyncpg

from agentd import conversations
from agentd.conversations import Note
from agentd.db import NOT_SENT, UNAVAILABLE, Db, database_time
from agentd.tools.registry import ToolError

log = logging.getLogger("agentd.tools")

_T = TypeVar("_T")
# The server refused the statement and rolled it back: a write made nothing.
_REFUSED = (asyncpg.exceptions.LockNotAvailableError, asyncpg.exceptions.DeadlockDetectedError,
            asyncpg.exceptions.QueryCanceledError)


class StoreUnavailable(ToolError):
    """The database did not answer a tool: the model reads why and may try again, and the
    turn goes on (a dropped connection is no reason to fail the whole turn)."""


async def _answered(call: Awaitable[_T], *, what: str, writes: bool = False) -> _T:
    try:
        return await call
    except (*UNAVAILABLE, *_REFUSED) as exc:
        log.warning(f"a tool's {what} met an unavailable database",
                    extra={"error": str(exc) or type(exc).__name__})
        if not writes:
            raise StoreUnavailable(f"the {what} failed: the database did not answer; "
                                   "try again") from None
        if isinstance(exc, (*NOT_SENT, *_REFUSED)):
            raise StoreUnavailable(f"the {what} failed: the database did not answer; "
                                   "nothing written, try again") from None
        # The connection went while the statement was out: it may have committed.
        raise StoreUnavailable(f"the {what} may or may not have been written: the "
                               "connection to the database broke before it answered; read "
                               "back before writing again") from None


class DatabaseToolStore:
    """Implements tools.registry.ToolStore; holds the pool so that tools do not."""

    def __init__(self, pool: Db) -> None:
        self._pool = pool

    async def database_time(self) -> datetime:
        return await _answered(database_time(self._pool), what="clock read")

    async def append_note(self, *, conversation_id: UUID, run_id: UUID, fence: int,
                          text: str) -> Note | None:
        return await _answered(conversations.append_note(
            self._pool, conversation_id=conversation_id, run_id=run_id, fence=fence, text=text),
            what="note", writes=True)

    async def note_fence_mark(self, conversation_id: UUID) -> int | None:
        return await _answered(conversations.note_fence_mark(self._pool, conversation_id),
                               what="notebook read")

    async def list_notes(self, conversation_id: UUID, limit: int) -> list[Note]:
        return await _answered(conversations.list_notes(self._pool, conversation_id, limit),
                               what="notebook read")
