"""`agenttui ask` and tool approvals, as a real process: it asks on a terminal (a real pty),
denies without one, and approves everything only when told to, loudly."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from tests.support.daemon import Daemon, SpawnDaemon, poll_until
from tests.support.factories import Device, new_device
from tests.tui.conftest import READY_TIMEOUT_S
from tests.tui.helpers import client_for
from tests.tui.test_cli import RUN_S, agenttui, finished

PARAMS = ["--param", "tool=\"calculator\"", "--param", 'tool_args={"expression": "6 * 7"}',
          "--param", "tokens=3", "--param", "delay_ms=0"]


@pytest.fixture
async def asking_daemon(spawn_daemon: SpawnDaemon, tmp_path: Path) -> Daemon:
    config = tmp_path / "agentd.toml"
    config.write_text('[tools]\ncalculator = "ask"\n', "utf-8")
    daemon = spawn_daemon(args=["--config", str(config)])
    await daemon.wait_ready(timeout=READY_TIMEOUT_S)
    return daemon


async def decisions(daemon: Daemon, desk: Device) -> list[tuple[str, str | None]]:
    async with client_for(daemon, desk) as api:
        [conversation] = await api.list_conversations()
        state = await api.get_conversation(conversation.id)
        run_id = state.messages[0].run_id or ""
        approvals = (await api._json("GET", f"/v1/runs/{run_id}/approvals"))["approvals"]
    return [(a["decision"], a["device"]) for a in approvals]


@contextlib.asynccontextmanager
async def asked_on_a_terminal(daemon: Daemon, device: Device, tmp_path: Path,
                              ) -> AsyncIterator[tuple[subprocess.Popen[bytes], Path, int]]:
    """`ask` on a real pseudo-terminal, once its question shows: (the process, the file its
    stderr goes to, the terminal's end to type on)."""
    master, slave = pty.openpty()
    errors = tmp_path / "stderr.txt"
    try:
        with errors.open("wb") as sink:
            proc = agenttui("ask", *PARAMS, "compute", url=daemon.url, token=device.token,
                            stdin=slave, stderr=sink)

            async def asked() -> bool:
                assert proc.poll() is None, errors.read_text()
                return "Allow it? [y/N]" in errors.read_text()

            await poll_until(asked, RUN_S, interval=0.05, what="the question on the terminal")
            yield proc, errors, master
    finally:
        os.close(master)
        os.close(slave)


async def test_without_a_terminal_the_call_is_denied(asking_daemon: Daemon,
                                                     desk: Device) -> None:
    proc = agenttui("ask", *PARAMS, "compute", url=asking_daemon.url, token=desk.token)
    stdout, stderr = proc.communicate(timeout=RUN_S)
    err = stderr.decode()
    assert proc.returncode == 0, err
    assert "denied calculator" in err and "stdin is not a terminal" in err, err
    assert "calculator denied by desk: agenttui ask: no terminal to ask on" in err, err
    assert "not run: denied by desk" in stdout.decode()
    assert await decisions(asking_daemon, desk) == [("deny", "desk")]


async def test_approve_all_approves_and_says_so_on_stderr(asking_daemon: Daemon,
                                                          desk: Device) -> None:
    proc = agenttui("ask", "--approve-all", *PARAMS, "compute", url=asking_daemon.url,
                    token=desk.token)
    stdout, stderr = proc.communicate(timeout=RUN_S)
    err = stderr.decode()
    assert proc.returncode == 0, err
    assert 'APPROVING calculator {"expression": "6 * 7"} without asking (--approve-all)' in err
    assert '"value": 42' in stdout.decode()
    assert await decisions(asking_daemon, desk) == [("approve", "desk")]


async def test_on_a_terminal_it_asks_and_takes_the_answer(asking_daemon: Daemon, desk: Device,
                                                          tmp_path: Path) -> None:
    async with asked_on_a_terminal(asking_daemon, desk, tmp_path) as (proc, errors, master):
        assert "run calculator" in errors.read_text() and "asked from desk" in \
            errors.read_text()
        os.write(master, b"y\n")
        code = await finished(proc)
        out = proc.stdout.read().decode() if proc.stdout else ""
    assert code == 0, errors.read_text()
    assert "calculator approved by desk" in errors.read_text()
    assert json.dumps({"expression": "6 * 7", "value": 42}) in out
    assert await decisions(asking_daemon, desk) == [("approve", "desk")]


async def test_a_line_typed_before_the_question_does_not_answer_it(
        asking_daemon: Daemon, desk: Device, tmp_path: Path) -> None:
    """A `y` typed ahead (while the model talked, or for a call another device decided just
    before) sat in the terminal and answered the next question at once: a call approved that
    nobody read."""
    master, slave = pty.openpty()
    errors = tmp_path / "stderr.txt"
    try:
        with errors.open("wb") as sink:
            proc = agenttui("ask", *PARAMS, "compute", url=asking_daemon.url,
                            token=desk.token, stdin=slave, stderr=sink)
            os.write(master, b"y\n")  # long before the question: the process is just starting

            async def asked() -> bool:
                assert proc.poll() is None, errors.read_text()
                return "Allow it? [y/N]" in errors.read_text()

            await poll_until(asked, RUN_S, interval=0.05, what="the question on the terminal")
            async with client_for(asking_daemon, desk) as api:
                [conversation] = await api.list_conversations()
                state = await api.get_conversation(conversation.id)
                run_id = state.messages[0].run_id or ""

                async def pending() -> bool:
                    approvals = (await api._json("GET", f"/v1/runs/{run_id}/approvals"))[
                        "approvals"]
                    return bool(approvals) and approvals[0]["decision"] is None

                await poll_until(pending, RUN_S, what="the call waiting for its answer")
            os.write(master, b"n\n")  # the answer given to the question once it is read
            code = await finished(proc)
    finally:
        os.close(master)
        os.close(slave)
    assert code == 0, errors.read_text()
    assert await decisions(asking_daemon, desk) == [("deny", "desk")]


async def test_another_devices_decision_is_printed_without_control_characters(
        asking_daemon: Daemon, desk: Device, pool: asyncpg.Pool, tmp_path: Path) -> None:
    # A device name and a note are other people's words: they must not retitle the window or
    # clear the screen of the terminal `ask` writes to.
    other = await new_device(pool, "team", "lap\x1b[31mtop")
    note = "fine\x1b]0;pwned\x07 by me\x1b[2J"
    async with asked_on_a_terminal(asking_daemon, desk, tmp_path) as (proc, errors, _):
        async with client_for(asking_daemon, other) as api:
            [conversation] = await api.list_conversations()
            state = await api.get_conversation(conversation.id)
            run_id = state.messages[0].run_id or ""
            [pending] = (await api._json("GET", f"/v1/runs/{run_id}/approvals"))[
                "approvals"]
            await api.decide_approval(run_id, pending["call_id"], "approve", note)
        code = await finished(proc)
    err = errors.read_text()
    assert code == 0, err
    assert "calculator approved by lap[31mtop: fine]0;pwned by me[2J" in err, err
    assert "\x1b" not in err and "\x07" not in err, err
