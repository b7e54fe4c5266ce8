"""The Markdown export keeps everything stored: whole tool results, arguments that hold
backticks, and exchanges a retry replaced (marked)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any
from uuid import UUID, uuid4

from agentd.conversations import Conversation, ConversationState, Message
from agentd.export import conversation_markdown
from agentd.vocabulary import MessageRole, MessageStatus

NOW = datetime(2026, 12, 7, 10, 0, tzinfo=UTC)


def _message(role: MessageRole, content: str, *, tool_calls: list[dict[str, Any]] | None = None,
             tool_call_id: str | None = None, superseded_by: UUID | None = None) -> Message:
    return Message(uuid4(), None, role, content, MessageStatus.COMPLETE, tool_calls,
                   tool_call_id, NOW, superseded_by)


def _export(*messages: Message) -> str:
    conversation = Conversation(uuid4(), uuid4(), "Notes", None, None, NOW, NOW)
    return conversation_markdown(ConversationState(conversation, list(messages), [], None))


def test_a_long_tool_result_is_exported_whole_and_its_backticks_cannot_close_the_block() -> None:
    output = "run `ls` then ```make``` " + "x" * 600 + " café END"
    stored = json.dumps({"output": output})  # as tool results are stored: ASCII escapes
    call = {"id": "c1", "name": "shell", "arguments": {"command": "echo `date`"}}
    text = _export(_message(MessageRole.USER, "list it"),
                   _message(MessageRole.ASSISTANT, "", tool_calls=[call]),
                   _message(MessageRole.TOOL, stored, tool_call_id="c1"),
                   _message(MessageRole.ASSISTANT, "done"))
    assert json.dumps({"output": output}, ensure_ascii=False) in text  # whole, café as itself
    assert "````\n{" in text  # a fence longer than the ``` inside the result
    assert '```json\n{"command": "echo `date`"}\n```' in text
    assert text.index("**Tool call** `shell`") < text.index("**Tool result**") < \
        text.index("done")


def test_a_result_stored_as_plain_text_or_odd_json_is_shown_as_stored() -> None:
    deep = "[" * 5000 + "]" * 5000  # JSON nested past what the decoder recurses into
    text = _export(_message(MessageRole.TOOL, "not json at all"),
                   _message(MessageRole.TOOL, '{"a":1}'),
                   _message(MessageRole.TOOL, deep))
    assert "```\nnot json at all\n```" in text
    assert '```\n{"a":1}\n```' in text
    assert f"```\n{deep}\n```" in text


def test_an_exchange_a_retry_replaced_is_kept_and_marked() -> None:
    retry = _message(MessageRole.USER, "second try")
    text = _export(_message(MessageRole.USER, "first try", superseded_by=retry.id),
                   _message(MessageRole.ASSISTANT, "old answer", superseded_by=retry.id),
                   retry, _message(MessageRole.ASSISTANT, "new answer"))
    assert "## You (replaced) · 2026-12-07 10:00 UTC\n\nfirst try" in text
    assert "## Assistant (replaced) · 2026-12-07 10:00 UTC\n\nold answer" in text
    assert "## You · 2026-12-07 10:00 UTC\n\nsecond try" in text
    assert "## Assistant · 2026-12-07 10:00 UTC\n\nnew answer" in text
