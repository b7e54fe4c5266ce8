"""`agenttui` as scripts run it: a real process, a live daemon, pipes and signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

from agentd.providers.demo import expected_answer
from agentd.vocabulary import MessageStatus, RunStatus
from agenttui.locations import config_file
from tests.support.daemon import Daemon, SpawnDaemon, poll_until
from tests.support.db import reachable_dir
from tests.support.factories import Device
from tests.tui.conftest import READY_TIMEOUT_S
from tests.tui.helpers import client_for

RUN_S = 120.0


def agenttui(*args: str, url: str | None = None, token: str | None = None,
             **kwargs) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    if url:
        env["AGENTTUI_URL"] = url
    if token:
        env["AGENTTUI_TOKEN"] = token
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen([sys.executable, "-m", "agenttui", *args], env=env, **kwargs)


async def finished(proc: subprocess.Popen[bytes], within: float = RUN_S) -> int:
    async def exited() -> bool:
        return proc.poll() is not None

    await poll_until(exited, within, interval=0.05, what="agenttui to exit")
    assert proc.returncode is not None
    return proc.returncode


def read(path: Path) -> str:
    return path.read_text("utf-8") if path.exists() else ""


async def test_ask_piped_to_a_file_writes_exactly_the_answer(
        daemon: Daemon, desk: Device, tmp_path: Path) -> None:
    prompt = "what is fencing for?"
    out = tmp_path / "answer.txt"
    with out.open("wb") as sink:
        proc = agenttui("ask", "--param", "tokens=70", "--param", "delay_ms=5", prompt,
                        url=daemon.url, token=desk.token, stdout=sink)
        code = await finished(proc)
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert code == 0, err
    assert out.read_text("utf-8") == expected_answer("demo", prompt, 70)
    assert err == ""

    # stdin works too, and --conversation last continues the same conversation.
    follow_up = tmp_path / "follow-up.txt"
    with follow_up.open("wb") as sink:
        proc = agenttui("ask", "--conversation", "last", "--param", "tokens=9",
                        url=daemon.url, token=desk.token, stdout=sink, stdin=subprocess.PIPE)
        proc.communicate(b"and why twice?\n", timeout=RUN_S)
    assert proc.returncode == 0
    assert follow_up.read_text("utf-8") == expected_answer("demo", "and why twice?\n", 9)
    async with client_for(daemon, desk) as api:
        [conversation] = await api.list_conversations()
        state = await api.get_conversation(conversation.id)
    assert [m.content for m in state.messages if m.role == "user"] == [prompt,
                                                                       "and why twice?\n"]


async def test_ask_exits_nonzero_with_a_message_when_the_run_fails(
        daemon: Daemon, desk: Device) -> None:
    proc = agenttui("ask", "--param", "tokens=10", "--param", "fail=3", "break please",
                    url=daemon.url, token=desk.token)
    stdout, stderr = proc.communicate(timeout=RUN_S)
    assert proc.returncode == 1
    assert stdout.decode() == " ".join(expected_answer("demo", "break please", 10).split()[:3])
    assert "the run failed: the model provider failed (provider_error)" in stderr.decode()
    assert "params.fail" not in stderr.decode()  # the detail is for the operator's log
    await daemon.wait_for_log("params.fail", timeout=10)


async def test_ask_model_picks_the_model_and_models_lists_them(
        spawn_daemon: SpawnDaemon, desk: Device) -> None:
    daemon = spawn_daemon(env={"AGENTD_DEMO_MODELS": "demo,echo", "OPENAI_API_KEY": ""})
    await daemon.wait_ready(timeout=READY_TIMEOUT_S)
    listed = agenttui("models", url=daemon.url, token=desk.token)
    out, err = listed.communicate(timeout=RUN_S)
    assert listed.returncode == 0, err.decode()
    lines = {line.split()[0]: line for line in out.decode().splitlines()}
    assert "usable (default)" in lines["demo"] and "usable" in lines["demo:echo"]
    assert "not usable: no API key" in lines["openai:gpt-4o"]
    as_json = agenttui("models", "--json", url=daemon.url, token=desk.token)
    out, _ = as_json.communicate(timeout=RUN_S)
    assert json.loads(out)["default_model"] == "demo"

    proc = agenttui("ask", "--model", "demo:echo", "--param", "tokens=6", "--param",
                    "delay_ms=0", "who is this?", url=daemon.url, token=desk.token)
    out, err = proc.communicate(timeout=RUN_S)
    assert proc.returncode == 0, err.decode()
    assert out.decode() == expected_answer("echo", "who is this?", 6)
    async with client_for(daemon, desk) as api:
        [conversation] = await api.list_conversations()
    assert conversation.model == "demo:echo"  # the conversation ask created keeps it
    # Its next turn, without --model, runs on it too.
    proc = agenttui("ask", "--conversation", "last", "--param", "tokens=3", "again",
                    url=daemon.url, token=desk.token)
    out, err = proc.communicate(timeout=RUN_S)
    assert proc.returncode == 0 and out.decode() == expected_answer("echo", "again", 3)

    refused = agenttui("ask", "--model", "openai:gpt-4o", "hello", url=daemon.url,
                       token=desk.token)
    out, err = refused.communicate(timeout=RUN_S)
    assert refused.returncode == 2 and out == b""
    assert "openai:gpt-4o" in err.decode() and "cannot be used now" in err.decode()


async def test_ctrl_c_stops_the_run_on_the_server(daemon: Daemon, desk: Device,
                                                  tmp_path: Path) -> None:
    out = tmp_path / "partial.txt"
    with out.open("wb") as sink:
        proc = agenttui("ask", "--param", "tokens=5000", "--param", "delay_ms=20",
                        "a very long answer", url=daemon.url, token=desk.token, stdout=sink)

        async def streaming() -> bool:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            return bool(read(out))

        await poll_until(streaming, RUN_S, what="the answer to start streaming")
        proc.send_signal(signal.SIGINT)
        code = await finished(proc)
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert code == 130, stderr
    assert "stopping the run" in stderr and "cancelled" in stderr
    async with client_for(daemon, desk) as api:
        [conversation] = await api.list_conversations()
        state = await api.get_conversation(conversation.id)
        answer = [m for m in state.messages if m.role == "assistant"]
        run = await api.get_run(answer[0].run_id or "")
    # Stopped, not merely disconnected: the server cancelled it and kept what was written.
    assert run.status == RunStatus.CANCELLED
    assert answer[0].status == MessageStatus.PARTIAL
    assert read(out) == answer[0].content


async def test_ctrl_c_while_the_daemon_does_not_answer_the_post_ends_ask_there() -> None:
    """A daemon that takes the connection and never answers (a black-holed link): Ctrl-C did
    nothing until the post's retries ran out, about a minute, and the turn was posted anyway.
    It now ends `ask` at once, saying the turn may have reached the daemon."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # reads nothing, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        proc = agenttui("ask", "anyone there?", url=url, token="agd_silent")
        await poll_until(lambda: accepted, RUN_S, what="ask to connect")
        proc.send_signal(signal.SIGINT)
        code = await finished(proc, within=10)
        stderr = proc.stderr.read().decode() if proc.stderr else ""
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
    assert code == 130, stderr
    assert "stopped before the daemon answered the post" in stderr, stderr
    assert "Traceback" not in stderr, stderr


async def test_login_verifies_then_stores_the_token_0600_keeping_other_settings(
        daemon: Daemon, desk: Device) -> None:
    path = config_file()
    path.write_text('theme = "nord"\n\n[keys]\nstop = "f8"\n')

    def login(url: str, token: str) -> tuple[int, str, str]:
        proc = agenttui("login", "--url", url, "--token", "-", stdin=subprocess.PIPE)
        stdout, stderr = proc.communicate(token.encode() + b"\n", timeout=RUN_S)
        return proc.returncode, stdout.decode(), stderr.decode()

    code, _, stderr = login("http://127.0.0.1:9/", desk.token)
    assert code == 4 and "login failed" in stderr
    assert "token" not in tomllib.loads(path.read_text())  # nothing stored when unverified

    # A token on the command line is refused outright (ps and shell history would keep it).
    proc = agenttui("login", "--url", daemon.url, "--token", desk.token)
    _, stderr_bytes = proc.communicate(timeout=RUN_S)
    assert proc.returncode == 2 and "--token -" in stderr_bytes.decode()
    assert desk.token not in stderr_bytes.decode()
    assert "token" not in tomllib.loads(path.read_text())

    code, stdout, stderr = login(daemon.url, desk.token)
    assert code == 0, stderr
    assert "as device 'desk'" in stdout
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    config = tomllib.loads(path.read_text())
    assert config == {"url": daemon.url, "token": desk.token, "device": "desk",
                      "theme": "nord", "keys": {"stop": "f8"}}

    code, _, stderr = login(daemon.url, "agd_wrong")
    assert code == 4 and "refused the token" in stderr
    assert tomllib.loads(path.read_text())["token"] == desk.token


async def test_a_local_daemon_sets_up_the_client_by_itself(spawn_daemon: SpawnDaemon) -> None:
    assert not config_file().exists()
    # Embedded PostgreSQL, the first-start path.
    with reachable_dir("agenttui local ") as data:
        local = spawn_daemon(dsn=None, name="local", args=["--data-dir", str(data / "pg")])
        await local.wait_ready(timeout=READY_TIMEOUT_S * 2)
        await _ask_with_no_setup()
        local.terminate()
        await local.wait_exit(timeout=READY_TIMEOUT_S)


async def _ask_with_no_setup() -> None:
    assert stat.S_IMODE(config_file().stat().st_mode) == 0o600
    proc = agenttui("ask", "--param", "tokens=4", "no setup at all")  # no URL, no token given
    stdout, stderr = proc.communicate(timeout=RUN_S)
    assert proc.returncode == 0, stderr.decode()
    assert stdout.decode() == expected_answer("demo", "no setup at all", 4)


def test_help_and_a_missing_token_say_what_to_do() -> None:
    proc = agenttui("--help")
    stdout, _ = proc.communicate(timeout=RUN_S)
    assert proc.returncode == 0
    for text in ("ask", "login", "--conversation", "exit codes", "AGENTTUI_"):
        assert text in stdout.decode(), text
    proc = agenttui("ask", "--help")
    stdout, _ = proc.communicate(timeout=RUN_S)
    assert proc.returncode == 0 and "--model" in stdout.decode() and "stdin" in stdout.decode()

    for args in ((), ("ask", "hello")):
        proc = agenttui(*args, url="http://127.0.0.1:9")
        _, stderr = proc.communicate(timeout=RUN_S)
        assert proc.returncode == 2
        assert "agentd pair --account A --device D" in stderr.decode()
