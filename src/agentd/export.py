"""A conversation as Markdown: the durable transcript, for people and for archives."""

from __future__ import annotations

import json

from agentd.conversations import ConversationState
from agentd.vocabulary import MessageRole, MessageStatus


def conversation_markdown(state: ConversationState) -> str:
    title = state.conversation.title or "Untitled conversation"
    lines = [f"# {title}", "",
             f"_exported from agentd · conversation {state.conversation.id}_", ""]
    for message in state.messages:
        if message.status == MessageStatus.DRAFT:
            continue
        stamp = message.created_at.strftime("%Y-%m-%d %H:%M UTC")
        if message.role == MessageRole.USER:
            lines += [f"## You · {stamp}", "", message.content, ""]
        elif message.role == MessageRole.ASSISTANT and message.tool_calls:
            for call in message.tool_calls:
                args = json.dumps(call.get("arguments", {}), ensure_ascii=False)
                lines += [f"> tool call `{call.get('name')}` {args}", ""]
        elif message.role == MessageRole.ASSISTANT:
            mark = "" if message.status == MessageStatus.COMPLETE else f" ({message.status})"
            lines += [f"## Assistant{mark} · {stamp}", "", message.content, ""]
        else:
            cancelled = " (cancelled)" if message.status == MessageStatus.CANCELLED else ""
            lines += [f"> tool result{cancelled}: `{message.content[:500]}`", ""]
    return "\n".join(lines).rstrip() + "\n"
