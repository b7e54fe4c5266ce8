"""The tool registry: validates a call's arguments against its schema before running it.

Each call receives the run's fence so a downstream resource can reject a superseded writer (a
uuid distinguishes executions, only a monotonic token orders them: docs/providers.md), and a
ToolStore: the only database operations a tool may perform. Tools never see the pool.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol
from uuid import UUID

from agentd.conversations import Note
from agentd.providers.base import ToolSpec


class ToolStore(Protocol):
    """What a tool may do to the database, and nothing more."""

    async def database_time(self) -> datetime: ...

    async def append_note(self, *, conversation_id: UUID, run_id: UUID, fence: int,
                          text: str) -> Note | None:
        """Append behind the notebook's fence; None (nothing written) for a superseded run."""

    async def note_fence_mark(self, conversation_id: UUID) -> int | None: ...

    async def list_notes(self, conversation_id: UUID, limit: int) -> list[Note]: ...


@dataclass(frozen=True, slots=True)
class ToolContext:
    run_id: UUID
    conversation_id: UUID
    account_id: UUID
    fence: int
    store: ToolStore


class ToolError(Exception):
    """A tool refused or failed; the model receives the message as the tool's result."""


ToolFn = Callable[[dict[str, Any], ToolContext], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    fn: ToolFn

    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,),
}


def validate_arguments(schema: dict[str, Any], args: Any) -> None:
    """The subset of JSON schema tools use: object, properties, required, types, enum, maxLength."""
    if isinstance(args, str):
        raise ToolError(f"arguments are not a JSON object: {args[:200]!r}")
    if not isinstance(args, dict):
        raise ToolError("arguments must be a JSON object")
    props: dict[str, Any] = schema.get("properties", {})
    for name in schema.get("required", []):
        if name not in args:
            raise ToolError(f"missing required argument {name!r}")
    if schema.get("additionalProperties") is False:
        extra = set(args) - set(props)
        if extra:
            raise ToolError(f"unexpected arguments: {sorted(extra)}")
    for name, value in args.items():
        rule = props.get(name)
        if rule is None:
            continue
        kind = rule.get("type")
        if kind is not None:
            allowed = _JSON_TYPES[kind]
            is_bool = isinstance(value, bool)
            if not isinstance(value, allowed) or (is_bool and kind != "boolean"):
                raise ToolError(f"argument {name!r} must be of type {kind}")
        if "enum" in rule and value not in rule["enum"]:
            raise ToolError(f"argument {name!r} must be one of {rule['enum']}")
        if "maxLength" in rule and isinstance(value, str) and len(value) > rule["maxLength"]:
            raise ToolError(f"argument {name!r} is longer than {rule['maxLength']}")


class ToolRegistry:
    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools = {tool.name: tool for tool in tools}

    def names(self) -> set[str]:
        return set(self._tools)

    def specs(self) -> list[ToolSpec]:
        return [tool.spec for tool in self._tools.values()]

    async def call(self, name: str, args: Any, ctx: ToolContext) -> Any:
        """Run a tool; bad arguments or a tool's own refusal raise ToolError, never crash."""
        tool = self._tools.get(name)
        if tool is None:
            raise ToolError(f"unknown tool {name!r}")
        validate_arguments(tool.parameters, args)
        return await tool.fn(args, ctx)


def default_tools() -> ToolRegistry:
    from agentd.tools.builtin import calculator_tool, clock_tool
    from agentd.tools.notes import notes_tool

    return ToolRegistry([clock_tool(), calculator_tool(), notes_tool()])
