"""The conversation list: the account's conversations, most recent first; select to switch."""

from __future__ import annotations

from typing import Any

from textual.widgets import OptionList
from textual.widgets.option_list import Option

from agenttui.models import Conversation


def conversation_label(conversation: Conversation) -> str:
    return conversation.title or "Untitled conversation"


MORE = "older"  # the entry that shows more of the list (no conversation id looks like it)


class ConversationList(OptionList):
    DEFAULT_CSS = """
    ConversationList { width: 30; height: 1fr; border: none; border-right: tall $panel; }
    """

    def __init__(self, **kwargs: Any) -> None:
        # Titles are the users' words: shown as typed, never parsed as markup.
        super().__init__(markup=False, **kwargs)
        self.conversations: list[Conversation] = []
        self.more = False
        self.current: str | None = None
        self.border_title = "Conversations"

    def set_conversations(self, conversations: list[Conversation],
                          current: str | None, *, more: bool = False) -> None:
        """`more`: older ones remain beyond these; the last entry offers to show them."""
        shown = len(self.conversations)
        # The "older" entry was picked: stay where the list grew, not back at the open one.
        grew = self.more and self.highlighted == shown and len(conversations) > shown
        if [(c.id, c.title) for c in conversations] != \
                [(c.id, c.title) for c in self.conversations] or more != self.more:
            self.conversations = list(conversations)
            self.more = more
            self.clear_options()
            self.add_options([Option(conversation_label(c), id=c.id) for c in conversations])
            if more:
                self.add_option(Option("… older conversations", id=MORE))
        if grew:
            self.current = current
            self.highlighted = shown
            return
        self.mark_current(current)

    def mark_current(self, current: str | None) -> None:
        self.current = current
        if current is None:
            return
        for index, conversation in enumerate(self.conversations):
            if conversation.id == current:
                self.highlighted = index
                return

    def neighbour(self, step: int) -> str | None:
        """The id `step` places away from the current one (wrapping), for quick switching."""
        if not self.conversations:
            return None
        ids = [c.id for c in self.conversations]
        index = ids.index(self.current) if self.current in ids else -step
        return ids[(index + step) % len(ids)]
