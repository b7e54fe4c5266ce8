"""The model each conversation was last seen with in this process: a guess, never an authority.

A post that names no model runs on its conversation's. Reading the conversation for it cost a
round trip on the way to every such turn's first token, though the daemon has usually just read
that row: the client attached to the conversation's feed before posting, and the feed re-reads the
conversation whenever it changes, here or in another process. So the service builds the request
on the model it last saw and the post's own statement checks it (queue.post_turn, `ModelGuess`):
a guess gone stale writes nothing and the service reads the conversation and posts again. Wrong
guesses cost a round trip; they can never put a turn on the wrong model. A post that locks the
conversation in a transaction of its own (`on_busy` reject or interrupt) checks the guess against
the model its lock answers, before it compares a repeat with the first run or stops anything.

Bounded: the least recently seen conversations are forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from uuid import UUID

from agentd.queue import ModelGuess

DEFAULT_CAPACITY = 10_000  # conversations: about a megabyte at most


class ConversationModels:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        # Keyed by account too: a guess is only ever made for the account that was shown the row.
        self._seen: OrderedDict[tuple[UUID, UUID], str | None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def seen(self, account_id: UUID, conversation_id: UUID, model: str | None) -> None:
        """The conversation's row was read (or written) just now, with this model."""
        key = (account_id, conversation_id)
        self._seen[key] = model
        self._seen.move_to_end(key)
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)

    def forget(self, account_id: UUID, conversation_id: UUID) -> None:
        self._seen.pop((account_id, conversation_id), None)

    def guess(self, account_id: UUID, conversation_id: UUID) -> ModelGuess | None:
        """The model last seen, or None when this process has not seen the conversation."""
        key = (account_id, conversation_id)
        if key not in self._seen:
            return None
        self._seen.move_to_end(key)
        return ModelGuess(self._seen[key])
