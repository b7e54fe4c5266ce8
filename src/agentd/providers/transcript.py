"""The transcript as every provider should see it: tool calls paired with results, system apart.

A turn that crashed between a tool call and its result leaves an unpaired call; real APIs reject
such a history, so every unanswered call gets a synthetic error result before it is sent.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any

UNANSWERED = json.dumps({"error": "no result: the turn ended before the tool answered"})
# What OpenAI's function names and Anthropic's tool names accept; agentd names MCP tools
# `<server>.<tool>`, and a dot is not in it.
WIRE_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class ToolNames:
    """agentd's tool names and the names a provider's wire format accepts, both ways.

    A name the wire accepts is sent as it is; any other is spelled with `__` for each dot and
    `_` for other characters, and a short hash when that is too long or already taken. The map
    is built per request from the offered tools and the names in the transcript, so what the
    model calls comes back under agentd's name.
    """

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._wire: dict[str, str] = {}
        self._local: dict[str, str] = {}
        for name in names:
            self.wire(name)

    @classmethod
    def for_request(cls, tools: Iterable[Any], messages: Iterable[dict[str, Any]]) -> ToolNames:
        names = [tool.name for tool in tools]
        for message in messages:
            names.extend(str(call.get("name", "")) for call in message.get("tool_calls") or [])
        return cls(names)

    def wire(self, name: str) -> str:
        if name in self._wire:
            return self._wire[name]
        wire = name if WIRE_TOOL_NAME.match(name) else \
            re.sub(r"[^a-zA-Z0-9_-]", "_", name.replace(".", "__"))[:64] or "tool"
        if wire in self._local or (wire != name and len(wire) == 64):  # taken, or cut short
            wire = f"{wire[:55]}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"
        self._wire[name], self._local[wire] = wire, name
        return wire

    def local(self, wire: str) -> str:
        return self._local.get(wire, wire)


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
    except (ValueError, RecursionError):  # nested too deep: as bad as not JSON at all
        return text
    return value if isinstance(value, dict) else text
