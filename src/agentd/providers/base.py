"""The one interface every model provider implements: an async iterator of stream items.

A provider turns (model, transcript, tool specs, params) into text deltas, tool-call requests,
usage and a finish reason. Cancelling the consuming task must close the upstream stream at once.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentd.pgtext import clean, clean_text

MAX_CALL_ID = 200  # the longest call id an approval stores (sql/010_tool_approvals.sql)


def storable_call_id(raw: str) -> str:
    """The id a model gave a tool call, as agentd stores and sends it back: cleaned (pgtext.py);
    none (or nothing but NULs) gets a fresh one, and one longer than MAX_CALL_ID its digest.
    A gateway's odd id used to fail, at the approval's insert, every turn that asked for one."""
    cleaned = clean_text(raw)
    if not cleaned:
        return f"call_{uuid.uuid4().hex}"
    if len(cleaned) > MAX_CALL_ID:
        return "call_" + hashlib.sha256(cleaned.encode()).hexdigest()[:40]
    return cleaned


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallRequest:
    id: str
    name: str
    # The decoded JSON object; the raw text when the model sent arguments that are not one
    # (the tool registry turns that into a tool error result the model can read and correct).
    arguments: dict[str, Any] | str

    def __post_init__(self) -> None:
        # What the model sent, made storable once (pgtext.py): the id and name are written to
        # the journal, the answer's tool calls and the approval, and matched between them, so
        # each must be the same text wherever it is stored.
        object.__setattr__(self, "id", storable_call_id(self.id))
        object.__setattr__(self, "name", clean_text(self.name))
        object.__setattr__(self, "arguments", clean(self.arguments))


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # "stop" | "tool_calls" | "length" | "content_filter"


StreamItem = TextDelta | ToolCallRequest | Usage | Finish


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=dict)  # JSON schema


class ProviderError(Exception):
    """The model provider failed; the run ends failed with `code` (a RunErrorCode) and a short
    client message for it. The text of the exception, which may name URLs, key variables and
    the provider's own words, goes to the daemon's log only."""

    def __init__(self, message: str, code: str = "provider_error") -> None:
        super().__init__(message)
        self.code = code


class UnknownModel(ValueError):
    """A run named a provider or model agentd cannot serve (a 400 at enqueue)."""


class Provider(Protocol):
    def stream(self, model: str, messages: list[dict[str, Any]], tools: list[ToolSpec],
               params: dict[str, Any]) -> AsyncGenerator[StreamItem, None]: ...
