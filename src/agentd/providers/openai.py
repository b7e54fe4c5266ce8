"""Any OpenAI-compatible chat-completions endpoint (OpenAI, Ollama, vLLM, llama.cpp server, LM
Studio), streamed: text deltas, tool calls assembled from their fragments, usage, finish reason.

The key is read from the environment variable the config names, per request; servers that need
none (a local Ollama) get no Authorization header when that variable is unset.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass
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
    make_client,
    parse_event_data,
    post_event_stream,
    required_base_url,
)
from agentd.providers.transcript import (
    ToolNames,
    arguments_json,
    decode_arguments,
    pair_tool_calls,
    split_system,
)
from agentd.settings import ProviderConfig

FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls",
                  "function_call": "tool_calls", "content_filter": "content_filter"}
# params a run may pass through to the endpoint (validated at enqueue by providers.params)
SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "seed", "stop", "presence_penalty",
                 "frequency_penalty")


@dataclass
class _PartialCall:
    """A tool call whose id, name and argument text arrive over several chunks."""

    id: str = ""
    name: str = ""
    arguments: str = ""

    def add_name(self, fragment: str) -> None:
        # OpenAI sends the name whole once; some servers repeat it in every fragment.
        if fragment != self.name:
            self.name += fragment

    def finish(self, names: ToolNames) -> ToolCallRequest:
        # An id that is none, or too long to store, is replaced by ToolCallRequest.
        return ToolCallRequest(self.id, names.local(self.name), decode_arguments(self.arguments))


def to_openai_messages(messages: list[dict[str, Any]], params: dict[str, Any],
                       names: ToolNames | None = None) -> list[dict[str, Any]]:
    """agentd's transcript (role, content, tool_calls, tool_call_id) in chat-completions form."""
    names = names or ToolNames()
    system, rest = split_system(messages, params)
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for message in pair_tool_calls(rest):
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            out.append({"role": "assistant", "content": message.get("content") or None,
                        "tool_calls": [
                            {"id": call["id"], "type": "function",
                             "function": {"name": names.wire(call["name"]),
                                          "arguments": arguments_json(call["arguments"])}}
                            for call in message["tool_calls"]]})
        elif role == "tool":
            out.append({"role": "tool", "tool_call_id": message["tool_call_id"],
                        "content": message["content"]})
        else:
            out.append({"role": role, "content": message["content"]})
    return out


def to_openai_tools(tools: list[ToolSpec],
                    names: ToolNames | None = None) -> list[dict[str, Any]]:
    names = names or ToolNames()
    return [{"type": "function", "function": {"name": names.wire(t.name),
                                              "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


class OpenAIProvider:
    """One shared httpx client per configured provider; closed by `aclose`."""

    def __init__(self, config: ProviderConfig, client: httpx.AsyncClient | None = None) -> None:
        self._base_url = required_base_url(config)
        self.config = config
        self._client = client or make_client(config)

    @property
    def url(self) -> str:
        return self._base_url.rstrip("/") + "/chat/completions"

    def request_body(self, model: str, messages: list[dict[str, Any]], tools: list[ToolSpec],
                     params: dict[str, Any], names: ToolNames | None = None) -> dict[str, Any]:
        names = names or ToolNames.for_request(tools, messages)
        body: dict[str, Any] = {
            "model": model, "messages": to_openai_messages(messages, params, names),
            "stream": True, "stream_options": {"include_usage": True}}
        if tools:
            body["tools"] = to_openai_tools(tools, names)
        body.update({key: params[key] for key in SAMPLING_KEYS if key in params})
        return body

    async def stream(self, model: str, messages: list[dict[str, Any]], tools: list[ToolSpec],
                     params: dict[str, Any]) -> AsyncGenerator[StreamItem, None]:
        headers = {}
        key = api_key(self.config)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        calls: dict[int, _PartialCall] = {}
        usage: Usage | None = None
        finish: str | None = None
        done = False
        names = ToolNames.for_request(tools, messages)
        events = post_event_stream(self._client, self.config, url=self.url, model=model,
                                   headers=headers,
                                   body=self.request_body(model, messages, tools, params, names))
        async with contextlib.aclosing(events):
            async for event in events:
                if event.data.strip() == "[DONE]":
                    done = True
                    break
                if not event.data.strip():
                    continue
                chunk = parse_event_data(self.config, event)
                if event.event == "error" or chunk.get("error"):
                    raise ProviderError(f"{self.config.name}: error mid-stream: "
                                        f"{error_detail(chunk)}")
                if chunk.get("usage"):
                    usage = Usage(int(chunk["usage"].get("prompt_tokens") or 0),
                                  int(chunk["usage"].get("completion_tokens") or 0))
                for choice in chunk.get("choices") or []:
                    if choice.get("index", 0) != 0:
                        continue  # n > 1 is never asked for
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        yield TextDelta(delta["content"])
                    for fragment in delta.get("tool_calls") or []:
                        call = calls.setdefault(int(fragment.get("index", len(calls))),
                                                _PartialCall())
                        call.id = fragment.get("id") or call.id
                        function = fragment.get("function") or {}
                        if function.get("name"):
                            call.add_name(function["name"])
                        call.arguments += function.get("arguments") or ""
                    if choice.get("finish_reason"):
                        finish = FINISH_REASONS.get(choice["finish_reason"],
                                                    choice["finish_reason"])
        if not done and finish is None:
            raise ProviderError(f"{self.config.name}: the stream ended before the answer did "
                                "(no finish_reason, no [DONE])")
        for index in sorted(calls):
            yield calls[index].finish(names)
        if usage is not None:
            yield usage
        yield Finish(finish or ("tool_calls" if calls else "stop"))

    async def aclose(self) -> None:
        await self._client.aclose()
