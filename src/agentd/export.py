"""A conversation as Markdown: the durable transcript, for people and for archives.

Nothing stored is left out or cut: tool arguments and results go whole into fenced blocks, and
an exchange that a retry or an edit replaced is kept, marked as replaced (as the API and the TUI
mark it), so the archive says which answer stood.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

from agentd.conversations import Conversation, ConversationState, Message
from agentd.vocabulary import MessageRole, MessageStatus

_BACKTICKS = re.compile(r"`+")


def conversation_markdown(state: ConversationState) -> str:
    """The whole document at once (the API streams the same text page by page)."""
    return "\n\n".join([markdown_head(state.conversation),
                        *markdown_blocks(state.messages)]) + "\n"


def markdown_head(conversation: Conversation) -> str:
    """The document's first block; every further block follows after a blank line, and the
    document ends with one newline."""
    title = conversation.title or "Untitled conversation"
    return f"# {title}\n\n_exported from agentd · conversation {conversation.id}_"


def markdown_blocks(messages: Iterable[Message]) -> Iterator[str]:
    """The blocks of these messages (drafts are no one's transcript yet)."""
    for message in messages:
        if message.status != MessageStatus.DRAFT:
            yield from _message_blocks(message)


def _message_blocks(message: Message) -> list[str]:
    stamp = message.created_at.strftime("%Y-%m-%d %H:%M UTC")
    replaced = " (replaced)" if message.superseded_by is not None else ""
    if message.role == MessageRole.USER:
        return [f"## You{replaced} · {stamp}\n\n{message.content}"]
    if message.role == MessageRole.ASSISTANT and message.tool_calls:
        blocks = []
        for call in message.tool_calls:
            arguments = call.get("arguments", {})
            # Arguments that are no JSON object are kept as the model sent them (text).
            text = arguments if isinstance(arguments, str) else _json(arguments)
            blocks.append(f"**Tool call** `{call.get('name')}`{replaced}\n\n"
                          f"{_fenced(text, 'json')}")
        return blocks
    if message.role == MessageRole.ASSISTANT:
        mark = "" if message.status == MessageStatus.COMPLETE else f" ({message.status})"
        return [f"## Assistant{mark}{replaced} · {stamp}\n\n{message.content}"]
    cancelled = " (cancelled)" if message.status == MessageStatus.CANCELLED else ""
    return [f"**Tool result**{cancelled}{replaced}\n\n{_fenced(_readable(message.content))}"]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _readable(content: str) -> str:
    """A result stored as JSON, with its non-ASCII text as itself rather than \\u escapes."""
    try:
        value = json.loads(content)
    except (ValueError, RecursionError):  # a tool's text nested too deep is shown as it is
        return content
    # Only the escapes change: a result stored some other way is shown exactly as stored.
    return _json(value) if json.dumps(value) == content else content


def _fenced(text: str, language: str = "") -> str:
    """`text` in a fenced code block whose fence no run of backticks inside it can close."""
    longest = max((len(run) for run in _BACKTICKS.findall(text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text}\n{fence}"
