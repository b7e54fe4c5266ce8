"""The ToolStore tools run against: each operation a tool may perform, on the daemon's pool."""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

from agentd import conversations
from agentd.conversations import Note
from agentd.db import Db, database_time


class DatabaseToolStore:
    """Implements tools.registry.ToolStore; holds the pool so that tools do not."""

    def __init__(self, pool: Db) -> None:
        self._pool = pool

    async def database_time(self) -> datetime:
        return await database_time(self._pool)

    async def append_note(self, *, conversation_id: UUID, run_id: UUID, fence: int,
                          text: str) -> Note | None:
        return await conversations.append_note(self._pool, conversation_id=conversation_id,
                                               run_id=run_id, fence=fence, text=text)

    async def note_fence_mark(self, conversation_id: UUID) -> int | None:
        return await conversations.note_fence_mark(self._pool, conversation_id)

    async def list_notes(self, conversation_id: UUID, limit: int) -> list[Note]:
        return await conversations.list_notes(self._pool, conversation_id, limit)
