"""Anthropic's Messages API, streamed: text and tool_use blocks (input_json_delta fragments),
usage from message_start and message_delta, the stop reason, and `error` events.

agentd's transcript is mapped to Anthropic's shape: the system prompt apart, tool calls as
tool_use blocks, tool results as tool_result blocks in the next user turn, roles alternating.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from agentd.providers.base import (
    Finish,
    ProviderError,
    StreamItem,
    TextDelta,
    ToolCallRequest,
    ToolSpec,
    Usage,
)
from agentd.providers.http_stream import (
    api_key,
    error_detail,
    key_hint,
    make_client,
    parse_event_data,
    post_event_stream,
    required_base_url,
)
from agentd.providers.transcript import (
    ToolNames,
    decode_arguments,
    pair_tool_calls,
    split_system,
)
from agentd.settings import ProviderConfig

API_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "pause_turn": "stop",
                "tool_use": "tool_calls", "max_tokens": "length", "refusal": "content_filter"}


def to_anthropic_messages(messages: list[dict[str, Any]], params: dict[str, Any],
                          names: ToolNames | None = None,
                          ) -> tuple[str | None, list[dict[str, Any]]]:
    """(system, messages): content blocks, tool results in user turns, same roles merged."""
    names = names or ToolNames()
    system, rest = split_system(messages, params)
    out: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})

    for message in pair_tool_calls(rest):
        text = message.get("content") or ""
        if message["role"] == "tool":
            add("user", [{"type": "tool_result", "tool_use_id": message["tool_call_id"],
                          "content": text}])
        elif message["role"] == "assistant":
            blocks = [{"type": "text", "text": text}] if text.strip() else []
            for call in message.get("tool_calls") or []:
                arguments = call["arguments"]
                blocks.append({"type": "tool_use", "id": call["id"],
                               "name": names.wire(call["name"]),
                               "input": arguments if isinstance(arguments, dict) else {}})
            add("assistant", blocks)
        elif text.strip():
            add("user", [{"type": "text", "text": text}])
    if out and out[0]["role"] != "user":
        out.insert(0, {"role": "user", "content": [{"type": "text", "text": "(continued)"}]})
    return system, out


def to_anthropic_tools(tools: list[ToolSpec],
                       names: ToolNames | None = None) -> list[dict[str, Any]]:
    names = names or ToolNames()
    return [{"name": names.wire(t.name), "description": t.description,
             "input_schema": t.parameters or {"type": "object", "properties": {}}}
            for t in tools]


class AnthropicProvider:
    """One shared httpx client per configured provider; closed by `aclose`."""

    def __init__(self, config: ProviderConfig, client: httpx.AsyncClient | None = None) -> None:
        self._base_url = required_base_url(config)
        self.config = config
        self._client = client or make_client(config)

    @property
    def url(self) -> str:
        base = self._base_url.rstrip("/")
        return base + ("/messages" if base.endswith("/v1") else "/v1/messages")

    def request_body(self, model: str, messages: list[dict[str, Any]], tools: list[ToolSpec],
                     params: dict[str, Any], names: ToolNames | None = None) -> dict[str, Any]:
        names = names or ToolNames.for_request(tools, messages)
        system, wire = to_anthropic_messages(messages, params, names)
        body: dict[str, Any] = {"model": model, "messages": wire, "stream": True,
                                "max_tokens": params.get("max_tokens", DEFAULT_MAX_TOKENS)}
        if system:
            body["system"] = system
        if tools:
            body["tools"] = to_anthropic_tools(tools, names)
        for key in ("temperature", "top_p", "top_k"):
            if key in params:
                body[key] = params[key]
        if "stop" in params:
            stop = params["stop"]
            body["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
        return body

    async def stream(self, model: str, messages: list[dict[str, Any]], tools: list[ToolSpec],
                     params: dict[str, Any]) -> AsyncGenerator[StreamItem, None]:
        key = api_key(self.config)
        if key is None:
            raise ProviderError(f"{self.config.name}: no API key: {key_hint(self.config)}",
                                "provider_auth")
        headers = {"x-api-key": key, "anthropic-version": API_VERSION}
        blocks: dict[int, dict[str, str]] = {}  # open tool_use blocks by index
        calls: list[ToolCallRequest] = []
        input_tokens = output_tokens = 0
        stop_reason: str | None = None
        done = False
        names = ToolNames.for_request(tools, messages)
        events = post_event_stream(self._client, self.config, url=self.url, model=model,
                                   headers=headers,
                                   body=self.request_body(model, messages, tools, params, names))
        async with contextlib.aclosing(events):
            async for event in events:
                if not event.data.strip():
                    continue
                data = parse_event_data(self.config, event)
                kind = event.event if event.event != "message" else data.get("type")
                if kind == "error" or data.get("type") == "error":
                    raise ProviderError(f"{self.config.name}: error mid-stream: "
                                        f"{error_detail(data)}")
                if kind == "message_start":
                    usage = (data.get("message") or {}).get("usage") or {}
                    input_tokens = _input_tokens(usage)
                    output_tokens = int(usage.get("output_tokens") or 0)
                elif kind == "content_block_start":
                    block = data.get("content_block") or {}
                    if block.get("type") == "tool_use":
                        # `input` is {} here; the arguments arrive as input_json_delta text.
                        blocks[int(data["index"])] = {"id": block["id"], "name": block["name"],
                                                      "json": ""}
                    elif block.get("type") == "text" and block.get("text"):
                        yield TextDelta(block["text"])
                elif kind == "content_block_delta":
                    delta = data.get("delta") or {}
                    if delta.get("type") == "text_delta" and delta.get("text"):
                        yield TextDelta(delta["text"])
                    elif delta.get("type") == "input_json_delta":
                        open_block = blocks.get(int(data["index"]))
                        if open_block is None:
                            raise ProviderError(f"{self.config.name}: input_json_delta for "
                                                f"block {data['index']}, which is not a tool_use")
                        open_block["json"] += delta.get("partial_json") or ""
                elif kind == "content_block_stop":
                    block = blocks.pop(int(data["index"]), None)
                    if block is not None:
                        calls.append(ToolCallRequest(block["id"], names.local(block["name"]),
                                                     decode_arguments(block["json"])))
                elif kind == "message_delta":
                    stop_reason = (data.get("delta") or {}).get("stop_reason") or stop_reason
                    usage = data.get("usage") or {}
                    if usage.get("output_tokens") is not None:
                        output_tokens = int(usage["output_tokens"])  # cumulative
                    if usage.get("input_tokens") is not None:
                        input_tokens = _input_tokens(usage)
                elif kind == "message_stop":
                    done = True
                    break
        if not done:
            raise ProviderError(f"{self.config.name}: the stream ended before message_stop")
        if blocks:
            raise ProviderError(f"{self.config.name}: the stream ended inside a tool_use block")
        for call in calls:
            yield call
        yield Usage(input_tokens, output_tokens)
        reason = STOP_REASONS.get(stop_reason or "end_turn", stop_reason or "stop")
        yield Finish("tool_calls" if calls else reason)

    async def aclose(self) -> None:
        await self._client.aclose()


def _input_tokens(usage: dict[str, Any]) -> int:
    """Input tokens billed: fresh ones plus those written to and read from the prompt cache."""
    return sum(int(usage.get(key) or 0) for key in (
        "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"))

