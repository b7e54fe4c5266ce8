"""The openai provider against a local server speaking chat-completions SSE, chunk by chunk.

What every provider must do (streaming, whole tool calls, usage, error codes, cancel) is in
test_contract.py; this file checks what is particular to the chat-completions wire format.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from agentd.providers.base import (
    Finish,
    ProviderError,
    StreamItem,
    TextDelta,
    ToolCallRequest,
    ToolSpec,
    Usage,
)
from agentd.providers.openai import OpenAIProvider
from agentd.settings import ProviderConfig
from tests.providers.fake_servers import (
    OPENAI_DONE,
    FakeServer,
    hang,
    openai_chunk,
    openai_error,
    openai_text,
    openai_tool_calls,
    sse,
    status,
)
from tests.support.daemon import free_port

KEY_ENV = "AGENTD_TEST_OPENAI_KEY"
USER = [{"role": "user", "content": "hello"}]
CALCULATOR = ToolSpec("calculator", "arithmetic", {
    "type": "object", "properties": {"expression": {"type": "string"}},
    "required": ["expression"]})


def provider(server: FakeServer, **changes: Any) -> OpenAIProvider:
    config = ProviderConfig("openai", "openai", base_url=server.base_url + "/v1",
                            api_key_env=KEY_ENV, timeout_s=changes.pop("timeout_s", 10.0))
    return OpenAIProvider(config)


async def collect(p: OpenAIProvider, messages: list[dict[str, Any]] = USER,
                  tools: list[ToolSpec] | None = None,
                  params: dict[str, Any] | None = None) -> list[StreamItem]:
    try:
        return [item async for item in p.stream("fake", messages, tools or [], params or {})]
    finally:
        await p.aclose()


async def test_text_stream_yields_deltas_then_usage_and_stop(
        fake: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-test-123")
    fake.script(sse(openai_text("Hel", "lo", ", world"), delay_s=0.01))
    items = await collect(provider(fake), params={"temperature": 0.2, "system": "be brief"})
    assert items == [TextDelta("Hel"), TextDelta("lo"), TextDelta(", world"), Usage(12, 5),
                     Finish("stop")]
    request = fake.received[0]
    assert request.path == "/v1/chat/completions"
    assert request.headers["Authorization"] == "Bearer sk-test-123"
    assert request.body["model"] == "fake"
    assert request.body["stream"] is True
    assert request.body["stream_options"] == {"include_usage": True}
    assert request.body["temperature"] == 0.2
    assert request.body["messages"] == [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "hello"}]
    assert "tools" not in request.body


async def test_no_authorization_header_when_the_key_variable_is_unset(
        fake: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers that need no key (a local Ollama) get none, rather than a failed run."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    fake.script(sse(openai_text("ok")))
    assert (await collect(provider(fake)))[0] == TextDelta("ok")
    assert "Authorization" not in fake.received[0].headers


async def test_tool_call_arguments_are_assembled_from_fragments_over_several_chunks(
        fake: FakeServer) -> None:
    fake.script(sse(openai_tool_calls([
        ("call_Qx1", "calculator", ['{"expr', 'ession": ', '"6 ', '* 7"}']),
        ("call_Qx2", "calculator", ['{"expression"', ': "1 + 1"', "}"]),
    ])))
    items = await collect(provider(fake), tools=[CALCULATOR])
    assert items == [ToolCallRequest("call_Qx1", "calculator", {"expression": "6 * 7"}),
                     ToolCallRequest("call_Qx2", "calculator", {"expression": "1 + 1"}),
                     Usage(30, 20), Finish("tool_calls")]
    tools = fake.received[0].body["tools"]
    assert tools == [{"type": "function", "function": {
        "name": "calculator", "description": "arithmetic", "parameters": CALCULATOR.parameters}}]


async def test_arguments_that_are_not_json_reach_the_executor_as_raw_text(
        fake: FakeServer) -> None:
    fake.script(sse(openai_tool_calls([("call_1", "calculator", ['{"expression": 6 *'])])))
    items = await collect(provider(fake), tools=[CALCULATOR])
    assert items[0] == ToolCallRequest("call_1", "calculator", '{"expression": 6 *')


async def test_transcript_with_tool_steps_is_sent_in_chat_completions_form(
        fake: FakeServer) -> None:
    fake.script(sse(openai_text("done")))
    messages = [
        {"role": "user", "content": "what is 6*7 and the time?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_a", "name": "calculator",
                         "arguments": {"expression": "6*7"}},
                        {"id": "call_b", "name": "clock", "arguments": {}}]},
        {"role": "tool", "content": '{"result": 42}', "tool_call_id": "call_a"},
        # call_b never got its result (the turn crashed): a synthetic one keeps it valid
        {"role": "user", "content": "and?"},
    ]
    await collect(provider(fake), messages=messages)
    assert fake.received[0].body["messages"] == [
        {"role": "user", "content": "what is 6*7 and the time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}},
            {"id": "call_b", "type": "function",
             "function": {"name": "clock", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"result": 42}'},
        {"role": "tool", "tool_call_id": "call_b",
         "content": json.dumps({"error": "no result: the turn ended before the tool answered"})},
        {"role": "user", "content": "and?"},
    ]


async def test_an_error_object_mid_stream_fails_with_the_servers_message(
        fake: FakeServer) -> None:
    fake.script(sse([openai_chunk({"role": "assistant", "content": ""}),
                     openai_chunk({"content": "partial"}),
                     openai_error("The server had an error while processing your request.")]))
    seen: list[StreamItem] = []
    p = provider(fake)
    with pytest.raises(ProviderError, match="error mid-stream: The server had an error"):
        async for item in p.stream("fake", USER, [], {}):
            seen.append(item)
    await p.aclose()
    assert seen == [TextDelta("partial")]


async def test_a_stream_cut_before_the_answer_finished_is_an_error(fake: FakeServer) -> None:
    fake.script(sse([openai_chunk({"content": "half an ans"})], then="cut"))
    with pytest.raises(ProviderError, match="openai"):
        await collect(provider(fake))


@pytest.mark.parametrize(("code", "body", "expected"), [
    (401, {"error": {"message": "Incorrect API key provided: sk-te***23.",
                     "type": "invalid_request_error", "code": "invalid_api_key"}},
     ["HTTP 401", "authentication failed", "Incorrect API key provided", KEY_ENV]),
    (404, {"error": {"message": "The model `fake` does not exist.",
                     "type": "invalid_request_error", "code": "model_not_found"}},
     ["HTTP 404", "'fake'", "does not exist"]),
    (400, {"error": "json: cannot unmarshal string into Go struct field"},  # Ollama's shape
     ["HTTP 400", "rejected", "cannot unmarshal"]),
    (500, "upstream exploded", ["HTTP 500", "provider failed", "upstream exploded"]),
])
async def test_http_errors_become_clear_provider_errors(
        fake: FakeServer, code: int, body: Any, expected: list[str]) -> None:
    fake.script(status(code, body))
    with pytest.raises(ProviderError) as failure:
        await collect(provider(fake))
    for part in expected:
        assert part in str(failure.value)
    assert len(fake.received) == 1  # not retried


async def test_429_with_retry_after_is_retried_then_succeeds(fake: FakeServer) -> None:
    limited = {"error": {"message": "Rate limit reached", "type": "requests",
                         "code": "rate_limit_exceeded"}}
    fake.script(status(429, limited, {"Retry-After": "1"}),
                status(429, limited, {"retry-after-ms": "50"}),
                sse(openai_text("finally")))
    started = time.monotonic()
    items = await collect(provider(fake))
    assert items[0] == TextDelta("finally")
    assert len(fake.received) == 3
    assert time.monotonic() - started >= 0.9, "Retry-After: 1 was not honoured"


async def test_429_that_never_clears_exhausts_the_retries_with_a_clear_error(
        fake: FakeServer) -> None:
    fake.script(status(429, {"error": {"message": "Rate limit reached", "type": "requests"}},
                       {"Retry-After": "0"}))
    with pytest.raises(ProviderError, match=r"HTTP 429.*rate limited.*gave up after 3 retries"):
        await collect(provider(fake))
    assert len(fake.received) == 4


async def test_429_asking_for_a_long_wait_fails_at_once(fake: FakeServer) -> None:
    fake.script(status(429, {"error": {"message": "quota"}}, {"Retry-After": "3600"}))
    with pytest.raises(ProviderError, match="asks to wait 3600 s"):
        await collect(provider(fake))
    assert len(fake.received) == 1


async def test_a_server_that_never_answers_fails_after_the_timeout(fake: FakeServer) -> None:
    fake.script(hang())
    with pytest.raises(ProviderError, match=r"timed out.*1 s.*providers\.openai\.timeout_s"):
        await asyncio.wait_for(collect(provider(fake, timeout_s=1.0)), 30)


async def test_a_server_that_goes_silent_mid_stream_fails_after_the_timeout(
        fake: FakeServer) -> None:
    fake.script(sse([openai_chunk({"content": "and then"})], then="hang"))
    seen: list[StreamItem] = []
    p = provider(fake, timeout_s=1.0)

    async def consume() -> None:
        async for item in p.stream("fake", USER, [], {}):
            seen.append(item)

    with pytest.raises(ProviderError, match="timed out"):
        await asyncio.wait_for(consume(), 30)
    await p.aclose()
    assert seen == [TextDelta("and then")]


async def test_a_refused_connection_is_a_clear_error() -> None:
    config = ProviderConfig("openai", "openai", base_url=f"http://127.0.0.1:{free_port()}/v1",
                            timeout_s=5.0)
    with pytest.raises(ProviderError, match=r"cannot connect to http://127\.0\.0\.1"):
        await collect(OpenAIProvider(config))


async def test_done_marker_ends_the_answer_even_before_the_connection_closes(
        fake: FakeServer) -> None:
    fake.script(sse([openai_chunk({"content": "x"}), openai_chunk({}, "stop"), OPENAI_DONE],
                    then="hang"))
    items = await asyncio.wait_for(collect(provider(fake, timeout_s=30)), 20)
    assert items == [TextDelta("x"), Finish("stop")]


MCP_TIME = ToolSpec("time.get_current_time", "the time", {
    "type": "object", "properties": {"timezone": {"type": "string"}}})


async def test_mcp_tool_names_with_dots_are_mapped_on_the_wire_and_back(
        fake: FakeServer) -> None:
    """OpenAI function names allow only ^[a-zA-Z0-9_-]{1,64}$: a `server.tool` goes out as
    `server__tool`, in the offered tools and in the transcript, and comes back dotted."""
    fake.script(sse(openai_tool_calls([("call_1", "time__get_current_time",
                                        ['{"timezone": "UTC"}'])])))
    history = [{"role": "user", "content": "time?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_0", "name": "time.get_current_time", "arguments": {}}]},
               {"role": "tool", "content": "{}", "tool_call_id": "call_0"},
               {"role": "user", "content": "again"}]
    items = await collect(provider(fake), messages=history, tools=[MCP_TIME, CALCULATOR])
    assert items[0] == ToolCallRequest("call_1", "time.get_current_time", {"timezone": "UTC"})
    body = fake.received[0].body
    assert [t["function"]["name"] for t in body["tools"]] == \
        ["time__get_current_time", "calculator"]
    assert body["messages"][1]["tool_calls"][0]["function"]["name"] == "time__get_current_time"
