"""The anthropic provider against a local server speaking the Messages API event stream.

What every provider must do (streaming, whole tool calls, usage, error codes, cancel) is in
test_contract.py; this file checks what is particular to the Messages API wire format.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentd.providers.anthropic import API_VERSION, AnthropicProvider
from agentd.providers.base import (
    Finish,
    ProviderError,
    StreamItem,
    TextDelta,
    ToolCallRequest,
    ToolSpec,
    Usage,
)
from agentd.settings import ProviderConfig
from tests.providers.fake_servers import (
    FakeServer,
    anthropic_error,
    anthropic_message,
    hang,
    sse,
    status,
)

KEY_ENV = "AGENTD_TEST_ANTHROPIC_KEY"
USER = [{"role": "user", "content": "what is 6*7?"}]
CALCULATOR = ToolSpec("calculator", "arithmetic", {
    "type": "object", "properties": {"expression": {"type": "string"}},
    "required": ["expression"]})


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-ant-test-456")


def provider(server: FakeServer, timeout_s: float = 10.0) -> AnthropicProvider:
    return AnthropicProvider(ProviderConfig("anthropic", "anthropic", base_url=server.base_url,
                                            api_key_env=KEY_ENV, timeout_s=timeout_s))


async def collect(p: AnthropicProvider, messages: list[dict[str, Any]] = USER,
                  tools: list[ToolSpec] | None = None,
                  params: dict[str, Any] | None = None) -> list[StreamItem]:
    try:
        return [item async for item in p.stream("claude-sonnet-4", messages, tools or [],
                                                params or {})]
    finally:
        await p.aclose()


async def test_full_event_sequence_with_text_and_a_tool_use_block(fake: FakeServer) -> None:
    fake.script(sse(anthropic_message([
        ("text", ["Let me ", "compute that."]),
        ("tool_use", ("toolu_01A09q90qw90lq917835lq9", "calculator",
                      ['{"expres', 'sion": "6', ' * 7"}'])),
    ], stop_reason="tool_use", usage=(472, 89)), delay_s=0.005))
    items = await collect(provider(fake), tools=[CALCULATOR],
                          params={"system": "You are terse.", "max_tokens": 256})
    assert items == [
        TextDelta("Let me "), TextDelta("compute that."),
        ToolCallRequest("toolu_01A09q90qw90lq917835lq9", "calculator",
                        {"expression": "6 * 7"}),
        Usage(472, 89), Finish("tool_calls")]
    request = fake.received[0]
    assert request.path == "/v1/messages"
    assert request.headers["x-api-key"] == "sk-ant-test-456"
    assert request.headers["anthropic-version"] == API_VERSION
    assert request.body["model"] == "claude-sonnet-4"
    assert request.body["stream"] is True
    assert request.body["max_tokens"] == 256
    assert request.body["system"] == "You are terse."
    assert request.body["tools"] == [{"name": "calculator", "description": "arithmetic",
                                      "input_schema": CALCULATOR.parameters}]
    assert request.body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "what is 6*7?"}]}]


async def test_plain_answer_ends_with_end_turn(fake: FakeServer) -> None:
    fake.script(sse(anthropic_message([("text", ["Forty", "-two."])], stop_reason="end_turn",
                                      usage=(10, 4))))
    assert await collect(provider(fake)) == [TextDelta("Forty"), TextDelta("-two."),
                                              Usage(10, 4), Finish("stop")]


async def test_transcript_maps_tool_steps_to_tool_use_and_tool_result_blocks(
        fake: FakeServer) -> None:
    fake.script(sse(anthropic_message([("text", ["ok"])], stop_reason="end_turn")))
    messages = [
        {"role": "user", "content": "6*7 and the time?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [{"id": "toolu_1", "name": "calculator",
                         "arguments": {"expression": "6*7"}},
                        {"id": "toolu_2", "name": "clock", "arguments": {}}]},
        {"role": "tool", "content": '{"result": 42}', "tool_call_id": "toolu_1"},
        {"role": "tool", "content": '{"result": "12:00"}', "tool_call_id": "toolu_2"},
        {"role": "assistant", "content": "42 at noon."},
        {"role": "user", "content": "thanks"},
        {"role": "user", "content": "and again?"},  # a cancelled turn left no answer
    ]
    await collect(provider(fake), messages=messages)
    body = fake.received[0].body
    assert "system" not in body
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "6*7 and the time?"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "calculator",
             "input": {"expression": "6*7"}},
            {"type": "tool_use", "id": "toolu_2", "name": "clock", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"result": 42}'},
            {"type": "tool_result", "tool_use_id": "toolu_2",
             "content": '{"result": "12:00"}'}]},
        {"role": "assistant", "content": [{"type": "text", "text": "42 at noon."}]},
        {"role": "user", "content": [{"type": "text", "text": "thanks"},
                                     {"type": "text", "text": "and again?"}]},
    ]


async def test_an_error_event_mid_stream_fails_with_its_type_and_message(
        fake: FakeServer) -> None:
    frames = anthropic_message([("text", ["Hal", "f"])], stop_reason="end_turn")
    fake.script(sse([*frames[:5], anthropic_error("overloaded_error", "Overloaded")]))
    seen: list[StreamItem] = []
    p = provider(fake)
    with pytest.raises(ProviderError, match=r"anthropic: error mid-stream: Overloaded "
                                            r"\(overloaded_error\)"):
        async for item in p.stream("claude-sonnet-4", USER, [], {}):
            seen.append(item)
    await p.aclose()
    assert seen == [TextDelta("Hal"), TextDelta("f")]


async def test_a_missing_key_fails_before_any_request(
        fake: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ProviderError, match=f"no API key.*{KEY_ENV} is not set"):
        await collect(provider(fake))
    assert fake.received == []


async def test_http_error_body_is_reported(fake: FakeServer) -> None:
    fake.script(status(400, {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}))
    with pytest.raises(ProviderError, match=r"HTTP 400.*max_tokens: Field required "
                                            r"\(invalid_request_error\)"):
        await collect(provider(fake))


async def test_overloaded_529_is_retried_then_succeeds(fake: FakeServer) -> None:
    fake.script(status(529, {"type": "error", "error": {"type": "overloaded_error",
                                                        "message": "Overloaded"}},
                       {"retry-after": "0"}),
                sse(anthropic_message([("text", ["fine"])], stop_reason="end_turn")))
    assert (await collect(provider(fake)))[0] == TextDelta("fine")
    assert len(fake.received) == 2


async def test_stream_without_message_stop_is_an_error(fake: FakeServer) -> None:
    frames = anthropic_message([("text", ["cut"])], stop_reason="end_turn")
    fake.script(sse(frames[:-2]))
    with pytest.raises(ProviderError, match="ended before message_stop"):
        await collect(provider(fake))


async def test_a_server_that_never_answers_fails_after_the_timeout(fake: FakeServer) -> None:
    fake.script(hang())
    with pytest.raises(ProviderError, match="timed out"):
        await asyncio.wait_for(collect(provider(fake, timeout_s=1.0)), 30)


async def test_mcp_tool_names_with_dots_are_mapped_on_the_wire_and_back(
        fake: FakeServer) -> None:
    """Anthropic tool names allow only ^[a-zA-Z0-9_-]{1,64}$ too: `server.tool` is sent as
    `server__tool` and the model's tool_use comes back under the dotted name."""
    spec = ToolSpec("time.get_current_time", "the time", {"type": "object", "properties": {}})
    fake.script(sse(anthropic_message([("tool_use", ("toolu_9", "time__get_current_time",
                                                     ["{}"]))], stop_reason="tool_use")))
    items = await collect(provider(fake), tools=[spec])
    assert items[0] == ToolCallRequest("toolu_9", "time.get_current_time", {})
    assert [t["name"] for t in fake.received[0].body["tools"]] == ["time__get_current_time"]
