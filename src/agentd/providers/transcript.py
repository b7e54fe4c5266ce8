"""The transcript as every provider should see it: tool calls paired with results, system apart.

A turn that crashed between a tool call and its result leaves an unpaired call; real APIs reject
such a history, so every unanswered call gets a synthetic error result before it is sent.
"""

from __future__ import annotations

import json
from typing import Any

UNANSWERED = json.dumps({"error": "no result: the turn ended before the tool answered"})


def split_system(messages: list[dict[str, Any]],
                 params: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]]]:
    """(system prompt, the other messages): params.system first, then any system messages."""
    parts = [params["system"]] if params.get("system") else []
    parts += [str(m["content"]) for m in messages if m["role"] == "system" and m["content"]]
    rest = [m for m in messages if m["role"] != "system"]
    return ("\n\n".join(parts) if parts else None), rest


def pair_tool_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each assistant tool call is followed by exactly one result; orphan results are dropped."""
    out: list[dict[str, Any]] = []
    index = 0
    while index < len(messages):
        message = messages[index]
        index += 1
        if message["role"] == "tool":
            continue  # a result whose call is not right before it: nothing can pair it
        out.append(message)
        calls = message.get("tool_calls") or []
        if message["role"] != "assistant" or not calls:
            continue
        results: dict[str, dict[str, Any]] = {}
        while index < len(messages) and messages[index]["role"] == "tool":
            results.setdefault(str(messages[index].get("tool_call_id")), messages[index])
            index += 1
        for call in calls:
            out.append(results.get(str(call["id"])) or {
                "role": "tool", "content": UNANSWERED, "tool_call_id": call["id"]})
    return out


def arguments_json(arguments: dict[str, Any] | str) -> str:
    """A call's arguments as the JSON text the OpenAI wire format carries."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def decode_arguments(text: str) -> dict[str, Any] | str:
    """Streamed argument text → the object; the raw text when it is not a JSON object."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
