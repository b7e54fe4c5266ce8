"""The tool registry: built-ins plus tool sources (MCP servers), each tool with its JSON schema,
checked by the `jsonschema` package, and its approval policy.

Each call receives the run's fence so a downstream resource can reject a superseded writer (a
uuid distinguishes executions, only a monotonic token orders them: docs/providers.md), and a
ToolStore: the only database operations a tool may perform. Tools never see the pool.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol
from uuid import UUID

import jsonschema
import referencing
import referencing.exceptions
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator

from agentd.conversations import Note
from agentd.providers.base import ToolSpec
from agentd.tools.schema_patterns import match_budget, unbounded_matching, with_deadline
from agentd.vocabulary import ApprovalPolicy

log = logging.getLogger("agentd.tools")

MAX_MESSAGE_CHARS = 300  # a validation message quotes the caller's value; keep it readable


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


class InvalidToolSchema(ValueError):
    """A tool's input schema is not a valid JSON schema: the tool is disabled, never offered."""


ToolFn = Callable[[dict[str, Any], ToolContext], Awaitable[Any]]


def _never_retrieved(uri: str) -> referencing.Resource[Any]:
    """A schema's `$ref` outside itself is never fetched: jsonschema's default would open the
    URI (http://, file://) synchronously, on the event loop and from the daemon's host, for
    whatever schema an MCP server lists."""
    raise referencing.exceptions.NoSuchResource(ref=uri)  # type: ignore[call-arg]  # attrs


# The drafts' own meta-schemas stay resolvable (jsonschema adds them to any registry).
_LOCAL_ONLY: referencing.Registry[Any] = referencing.Registry(  # type: ignore[call-arg]
    retrieve=_never_retrieved)


def compile_schema(schema: Any) -> Validator:
    """A validator for a tool's input schema (its `$schema` draft, else 2020-12); raises
    InvalidToolSchema when the schema itself is invalid."""
    if not isinstance(schema, dict):
        raise InvalidToolSchema("the input schema is not a JSON object")
    try:
        cls = jsonschema.validators.validator_for(schema,
                                                  default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise InvalidToolSchema(f"invalid input schema{f' at {where}' if where else ''}: "
                                f"{_short(exc.message)}") from None
    except Exception as exc:  # e.g. a `$schema` that is no string: jsonschema's own errors
        raise InvalidToolSchema(f"invalid input schema ({type(exc).__name__})") from None
    if schema.get("type", "object") != "object":
        raise InvalidToolSchema("the input schema must describe a JSON object")
    if unbounded_matching(schema):
        raise InvalidToolSchema("unevaluatedProperties beside patternProperties is not "
                                "supported: those patterns could not be matched under a deadline")
    return with_deadline(cls)(schema, registry=_LOCAL_ONLY)


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    fn: ToolFn
    policy: ApprovalPolicy = ApprovalPolicy.AUTO
    source: str = "builtin"  # or the MCP server's name
    validator: Validator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "validator", compile_schema(self.parameters))

    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)

    def check_arguments(self, args: Any) -> dict[str, Any]:
        """The arguments as a dict, or ToolError with the validator's message (which the model
        reads, so it can correct the call)."""
        if isinstance(args, str):
            raise ToolError(f"arguments are not a JSON object: {args[:200]!r}")
        if not isinstance(args, dict):
            raise ToolError("arguments must be a JSON object")
        try:
            with match_budget():
                error = best_match(self.validator.iter_errors(args))
        except TimeoutError:  # schema_patterns: a pattern that backtracks without end
            raise ToolError(f"the arguments of {self.name} cannot be checked: a pattern of its "
                            "input schema took too long to match them") from None
        except referencing.exceptions.Unresolvable:
            raise ToolError(f"the arguments of {self.name} cannot be checked: its input "
                            "schema holds a $ref it cannot resolve within itself (other schemas "
                            "are never fetched)") from None
        except (Exception, RecursionError) as exc:
            # The schema cannot check them (arguments nested past the stack): the tool's
            # fault, told to the model as its result; the turn goes on.
            raise ToolError(f"the arguments of {self.name} cannot be checked against its "
                            f"input schema ({type(exc).__name__})") from None
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            message = error.message
            quoted = repr(error.instance)
            if len(quoted) > 60:  # the message quotes the value: keep the reason readable
                message = message.replace(quoted, quoted[:40] + "…")
            raise ToolError(f"invalid arguments for {self.name}"
                            f"{f' at {where}' if where else ''}: {_short(message)}")
        return args


def _short(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "…"


class ToolSource(Protocol):
    """Tools from outside the process (MCP servers): listed and found on demand."""

    async def tools(self) -> list[Tool]: ...

    async def find(self, name: str) -> Tool | None: ...


class ToolRegistry:
    def __init__(self, tools: Iterable[Tool] = (), *,
                 policies: Mapping[str, ApprovalPolicy] | None = None,
                 sources: Iterable[ToolSource] = ()) -> None:
        policies = policies or {}
        self._tools = {tool.name: _with_policy(tool, policies.get(tool.name))
                       for tool in tools}
        self._sources = list(sources)

    def names(self) -> set[str]:
        """The built-in tools' names (a source's tools are found with `find`)."""
        return set(self._tools)

    async def all_tools(self) -> list[Tool]:
        found = list(self._tools.values())
        for source in self._sources:
            found.extend(await source.tools())
        return found

    async def specs(self) -> list[ToolSpec]:
        """What the model is offered: every tool but those whose policy is `deny`."""
        return [tool.spec for tool in await self.all_tools()
                if tool.policy != ApprovalPolicy.DENY]

    async def find(self, name: str) -> Tool | None:
        tool = self._tools.get(name)
        if tool is not None:
            return tool
        for source in self._sources:
            tool = await source.find(name)
            if tool is not None:
                return tool
        return None

    async def call(self, name: str, args: Any, ctx: ToolContext) -> Any:
        """Run a tool by name, whatever its policy; bad arguments or a tool's own refusal
        raise ToolError, never crash. (The executor, which checks the arguments before it asks
        for approval, runs the tool it found itself.)"""
        tool = await self.find(name)
        if tool is None:
            raise ToolError(f"unknown tool {name!r}")
        return await tool.fn(tool.check_arguments(args), ctx)


def _with_policy(tool: Tool, policy: ApprovalPolicy | None) -> Tool:
    if policy is None or policy == tool.policy:
        return tool
    return Tool(tool.name, tool.description, tool.parameters, tool.fn, policy, tool.source)


def result_text(result: Any) -> str:
    """A tool's result as the JSON text the transcript stores."""
    return json.dumps(result, default=str, ensure_ascii=False)


def default_tools(policies: Mapping[str, ApprovalPolicy] | None = None,
                  sources: Iterable[ToolSource] = ()) -> ToolRegistry:
    from agentd.tools.builtin import calculator_tool, clock_tool
    from agentd.tools.notes import notes_tool

    return ToolRegistry([clock_tool(), calculator_tool(), notes_tool()], policies=policies,
                        sources=sources)
