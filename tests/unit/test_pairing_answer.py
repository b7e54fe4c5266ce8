"""A pairing's answer names the URL other machines reach the daemon by; on a wildcard address
that is the host's name, a DNS lookup that can take seconds. It runs off the event loop, so the
process's streams and leases go on meanwhile."""

from __future__ import annotations

import asyncio
import socket
import threading
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentd.api.devices import pairing_answer
from agentd.pairing import Pairing
from agentd.settings import load_settings


async def test_the_host_name_lookup_does_not_hold_up_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "agentd.toml"
    config.write_text('listen = "0.0.0.0:8740"\ninsecure_http = true\n')
    settings = load_settings(config, env={})
    loop_ran = threading.Event()
    seen: list[bool] = []

    def slow_lookup() -> str:
        # A resolver that answers late: meanwhile the loop must run its other tasks (on the
        # loop's own thread, this wait would end unanswered).
        seen.append(loop_ran.wait(5))
        return "desk.example"

    monkeypatch.setattr(socket, "getfqdn", slow_lookup)

    async def meanwhile() -> None:
        loop_ran.set()  # runs only once the lookup's task has let the loop go

    runtime = SimpleNamespace(settings=settings, certificate=None)
    made = Pairing("7K3QX-M9V2D", datetime(2026, 1, 1, tzinfo=UTC))
    answer, _ = await asyncio.gather(pairing_answer(runtime, made), meanwhile())
    assert answer["url"] == "http://desk.example:8740"
    assert seen == [True], "the event loop stood still during the lookup"
