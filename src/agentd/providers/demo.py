"""The offline demo model: deterministic, paced like a real stream, and able to call tools.

Per-run params shape it for tests and benchmarks: `tokens` (answer length), `delay_ms` (pause
between deltas), `tool` (call that tool once first, any registered tool, MCP ones included) with
`tool_args` (a JSON object: its arguments), `fail` (raise after that many tokens).
Same transcript and params, same output.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncGenerator
from typing import Any

from agentd.providers.base import (
    Finish,
    ProviderError,
    StreamItem,
    TextDelta,
    ToolCallRequest,
    ToolSpec,
    Usage,
)

WORDS = (
    "the", "run", "is", "a", "row", "lease", "fence", "journal", "stream", "cursor", "turn",
    "queue", "worker", "claim", "token", "stop", "durable", "conversation", "device", "agent",
    "postgres", "notify", "heartbeat", "reaper", "commit", "resume", "answer", "tool", "model",
    "survives", "never", "twice", "every", "write", "is", "fenced",
)
DEFAULT_TOKENS = 40
DEFAULT_DELAY_MS = 25
PARAM_LIMITS = {"tokens": (0, 100_000), "delay_ms": (0, 60_000), "fail": (0, 100_000)}
DEMO_TOOL_ARGS = {"clock": {}, "calculator": {"expression": "6 * 7"},
                  "notes": {"action": "append", "text": "demo note"}}
MAX_ECHO_CHARS = 400  # how much of a tool's result the answer repeats


def validate_params(params: dict[str, Any], max_run_s: float | None = None) -> dict[str, Any]:
    """Check demo params' shapes; raises ValueError naming the bad one. Whether `tool` names a
    registered tool is checked by the caller (an MCP tool is found only by asking its server).
    With `max_run_s`, the answer's pacing (tokens × delay_ms) must fit the turn deadline: a
    demo turn never fails by design."""
    unknown = set(params) - {*PARAM_LIMITS, "tool", "tool_args"}
    if unknown:
        raise ValueError(f"unknown demo params: {sorted(unknown)}")
    for key, (low, high) in PARAM_LIMITS.items():
        if key in params:
            value = params[key]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"params.{key} must be an integer in [{low}, {high}]")
    if "tool" in params and (not isinstance(params["tool"], str) or
                             not 0 < len(params["tool"]) <= 200):
        raise ValueError("params.tool must be a tool name")
    if "tool_args" in params:
        if "tool" not in params:
            raise ValueError("params.tool_args needs params.tool")
        if not isinstance(params["tool_args"], dict):
            raise ValueError("params.tool_args must be a JSON object")
    paced_s = params.get("tokens", DEFAULT_TOKENS) * params.get("delay_ms", DEFAULT_DELAY_MS) \
        / 1000
    if max_run_s is not None and paced_s > max_run_s:
        raise ValueError(f"params.tokens × params.delay_ms is {paced_s:g} s of streaming, more "
                         f"than a turn may run ({max_run_s:g} s)")
    return params


def _words(seed: str, count: int) -> list[str]:
    out: list[str] = []
    block = 0
    while len(out) < count:
        digest = hashlib.sha256(f"{seed}:{block}".encode()).digest()
        out.extend(WORDS[b % len(WORDS)] for b in digest)
        block += 1
    return out[:count]


class DemoProvider:
    """Streams a deterministic answer derived from the last user message."""

    async def stream(self, model: str, messages: list[dict[str, Any]], tools: list[ToolSpec],
                     params: dict[str, Any]) -> AsyncGenerator[StreamItem, None]:
        tokens = int(params.get("tokens", DEFAULT_TOKENS))
        delay = int(params.get("delay_ms", DEFAULT_DELAY_MS)) / 1000
        fail_after = params.get("fail")
        tool = params.get("tool")
        prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        input_tokens = sum(len(str(m.get("content") or "").split()) for m in messages)

        # Tool first: once per turn, i.e. until a tool result follows the last user message.
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        results = [m for m in messages[last_user + 1:] if m["role"] == "tool"]
        if tool and not results:
            # Any tool, offered or not: a test can make it call a tool the policy hides.
            args = params.get("tool_args")
            if args is None:
                args = DEMO_TOOL_ARGS.get(tool, {})
            call_id = "call_" + hashlib.sha256(f"{prompt}:{tool}".encode()).hexdigest()[:12]
            yield ToolCallRequest(call_id, tool, json.loads(json.dumps(args)))
            yield Usage(input_tokens, 1)
            yield Finish("tool_calls")
            return

        words = _words(f"{model}:{prompt}", tokens)
        if results:
            words = ["tool", "said:", str(results[-1]["content"])[:MAX_ECHO_CHARS], *words]
        for index, word in enumerate(words):
            if fail_after is not None and index >= fail_after:
                raise ProviderError(f"demo provider failed after {index} tokens (params.fail)")
            if delay:
                await asyncio.sleep(delay)
            yield TextDelta(word if index == 0 else " " + word)
        if fail_after is not None and len(words) <= fail_after:
            raise ProviderError(f"demo provider failed after {len(words)} tokens (params.fail)")
        yield Usage(input_tokens, len(words))
        yield Finish("stop")


def expected_answer(model: str, prompt: str, tokens: int = DEFAULT_TOKENS) -> str:
    """The exact text the demo model answers to `prompt` without tools (for tests and bench)."""
    return " ".join(_words(f"{model}:{prompt}", tokens))
