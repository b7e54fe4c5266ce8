"""Every `agentd` and `agenttui` subcommand answers bad input with one line and a non-zero exit.

Malformed values, an unreachable server or database, and input the server refuses are what a
new user types first: each must name the problem in a single `agentd: …` / `agenttui: …` line
on stderr, never show a Python traceback, and exit non-zero (2 for usage, as argparse does).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from agentd.accounts import create_device_token
from tests.support.daemon import free_port

TIMEOUT_S = 120


def other_database(dsn: str, database: str | None = None, user: str | None = None) -> str:
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{user}@{host}" if user else parts.netloc
    path = "/" + database if database else parts.path
    return urlunsplit((parts.scheme, netloc, path, parts.query, parts.fragment))


def run(program: str, *args: str, home: Path,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("AGENTD_", "AGENTTUI_"))}
    clean.update({"XDG_CONFIG_HOME": str(home / "config"), "XDG_DATA_HOME": str(home / "data"),
                  "AGENTTUI_CONFIG_DIR": str(home / "agenttui"),
                  "AGENTTUI_STATE_DIR": str(home / "state"),
                  "AGENTTUI_CACHE_DIR": str(home / "cache")})
    return subprocess.run([sys.executable, "-m", program, *args], capture_output=True,
                          text=True, timeout=TIMEOUT_S, env={**clean, **(env or {})},
                          stdin=subprocess.DEVNULL, check=False)


def assert_one_line(result: subprocess.CompletedProcess[str], program: str, code: int,
                    *words: str) -> None:
    shown = f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    assert "Traceback" not in result.stderr + result.stdout, shown
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, shown
    assert lines[0].partition(":")[0].split()[0] == program, shown  # `agentd token: …` too
    assert result.returncode == code, shown
    for word in words:
        assert word in lines[0], shown


# (arguments, exit code, words the line must hold). {dsn} is this test's database,
# {unreachable} a port nothing listens on, {no_db} / {no_role} a database / role that do not
# exist on the test's server.
AGENTD_CASES = {
    "serve-dsn-not-a-url": (["serve", "--dsn", "not a dsn"], 2, ["dsn", "postgresql://"]),
    "serve-dsn-bad-ipv6": (["serve", "--dsn", "postgresql://x@[::1/db"], 2, ["dsn"]),
    "serve-listen": (["serve", "--listen", "nowhere"], 2, ["listen"]),
    "serve-listen-port": (["serve", "--listen", "127.0.0.1:99999"], 2, ["listen"]),
    "serve-unknown-option": (["serve", "--frobnicate"], 2, ["--frobnicate"]),
    "serve-config-missing": (["serve", "--config", "/nonexistent/agentd.toml"], 2,
                             ["does not exist"]),
    # A data directory under a file: its tls/ cannot be made (root included). It was told as
    # "cannot reach the database", which sent the operator after the wrong thing.
    "serve-data-dir-unusable": (["serve", "--dsn", "{dsn}", "--listen",
                                 "127.0.0.1:{unreachable}"], 1,
                                ["cannot use", "Not a directory"]),
    "pair-empty-account": (["pair", "--dsn", "{dsn}", "--account", "", "--device", "x"], 2,
                           ["--account"]),
    "pair-long-device": (["pair", "--dsn", "{dsn}", "--account", "a", "--device", "d" * 201],
                         2, ["--device", "200"]),
    "pair-missing-device": (["pair", "--account", "a"], 2, ["--device"]),
    "migrate-unreachable": (["migrate", "--dsn", "postgresql://nobody@127.0.0.1:{unreachable}"
                             "/none"], 1, ["cannot reach the database"]),
    "migrate-sslmode": (["migrate", "--dsn", "{dsn_sslmode}"], 2, ["sslmode"]),
    "token-no-action": (["token"], 2, ["ACTION"]),
    "token-create-empty-account": (["token", "create", "--dsn", "{dsn}", "--account", "",
                                    "--device", "x"], 2, ["--account", "empty"]),
    "token-create-control-char": (["token", "create", "--dsn", "{dsn}", "--account", "a",
                                   "--device", "a\x01b"], 2, ["--device", "control"]),
    "token-list-no-database": (["token", "list", "--dsn", "{no_db}"], 1,
                               ["the database refused", "does not exist"]),
    "token-revoke-not-an-id": (["token", "revoke", "--dsn", "{dsn}", "not-a-uuid"], 2,
                               ["not a device id"]),
    "token-revoke-unknown": (["token", "revoke", "--dsn", "{dsn}", str(uuid.UUID(int=1))], 1,
                             ["no device"]),
    "account-set-not-a-number": (["account", "set", "a", "--dsn", "{dsn}", "--max-running",
                                  "lots"], 2, ["--max-running"]),
    "account-set-empty-name": (["account", "set", "", "--dsn", "{dsn}", "--max-queued", "1"],
                               2, ["account name"]),
    "account-set-nothing": (["account", "set", "a", "--dsn", "{dsn}"], 2, ["nothing to set"]),
    "account-show-unknown": (["account", "show", "nobody", "--dsn", "{dsn}"], 1, ["nobody"]),
    "status-no-role": (["status", "--dsn", "{no_role}"], 1, ["the database refused"]),
    "status-bad-setting": (["status", "--dsn", "{dsn}"], 2, ["lease_ttl_s"]),
    "doctor-other-scheme": (["doctor", "--dsn", "mysql://root@127.0.0.1/db"], 2, ["dsn"]),
    "install-service-bad-listen": (["install-service", "--no-enable", "--", "--listen",
                                    "nowhere"], 2, ["listen"]),
    "install-service-bad-option": (["install-service", "--no-enable", "--", "--frobnicate"],
                                   2, ["--frobnicate"]),
    "no-such-command": (["frobnicate"], 2, ["frobnicate"]),
}


@pytest.mark.parametrize("case", sorted(AGENTD_CASES))
def test_agentd_answers_bad_input_with_one_line(case: str, dsn: str, tmp_path: Path) -> None:
    args, code, words = AGENTD_CASES[case]
    # The embedded server's DSN already has a query (socket, password file): add to it.
    sslmode = ("&" if "?" in dsn else "?") + "sslmode=sometimes"
    values = {"dsn": dsn, "dsn_sslmode": dsn + sslmode, "unreachable": str(free_port()),
              "no_db": other_database(dsn, database=f"missing_{uuid.uuid4().hex[:8]}"),
              "no_role": other_database(dsn, user=f"nobody_{uuid.uuid4().hex[:8]}"),
              "a_file": str(tmp_path / "a-file")}
    (tmp_path / "a-file").write_text("")
    env = {"status-bad-setting": {"AGENTD_LEASE_TTL_S": "soon"},
           "serve-data-dir-unusable": {"AGENTD_TLS": "on",
                                       "AGENTD_DATA_DIR": str(tmp_path / "a-file" / "agentd")},
           }.get(case)
    result = run("agentd", *[arg.format(**values) for arg in args], home=tmp_path, env=env)
    assert_one_line(result, "agentd", code, *words)
    if case.startswith("install-service"):
        assert not (tmp_path / "config" / "systemd").exists()  # refused before writing


# case: (arguments, $AGENTTUI_TOKEN or None, exit code, words the one line must hold). A token
# is never taken from the command line (the process list shows it to every local user).
AGENTTUI_OFFLINE_CASES: dict[str, tuple[list[str], str | None, int, list[str]]] = {
    "ask-unreachable": (["ask", "--url", "http://127.0.0.1:{unreachable}", "hi"], "x", 4,
                        ["cannot reach"]),
    "models-unreachable": (["models", "--url", "http://127.0.0.1:{unreachable}"], "x", 4,
                           ["cannot reach"]),
    "login-unreachable": (["login", "http://127.0.0.1:{unreachable}", "--code",
                           "ABCDE-FGHIJ"], None, 4, ["cannot reach"]),
    "ask-not-a-url": (["ask", "--url", "not a url", "hi"], "x", 2, ["not a daemon URL"]),
    "ask-bad-ipv6": (["ask", "--url", "http://[::1", "hi"], "x", 2, ["not a daemon URL"]),
    "models-bad-port": (["models", "--url", "http://127.0.0.1:99999"], "x", 2, ["port"]),
    "tui-not-a-url": (["--url", "ftp://example.org"], "x", 2, ["not a daemon URL"]),
    "ask-non-ascii-token": (["ask", "--url", "http://127.0.0.1:1", "hi"], "tøken", 2,
                            ["token"]),
    "ask-bad-param": (["ask", "--url", "http://127.0.0.1:1", "--param", "=1", "hi"], "x", 2,
                      ["KEY=VALUE"]),
    "ask-nothing": (["ask", "--url", "http://127.0.0.1:1"], "x", 2, ["nothing to ask"]),
    "ask-no-token": (["ask", "--url", "http://127.0.0.1:1", "hi"], None, 2,
                     ["no device token", "agenttui login"]),
    "models-no-token": (["models", "--url", "http://127.0.0.1:1"], None, 2,
                        ["no device token"]),
    "ask-token-argument": (["ask", "--url", "http://127.0.0.1:1", "--token", "secret", "hi"],
                           None, 2, ["command line", "AGENTTUI_TOKEN"]),
    "models-token-argument": (["models", "--token", "secret"], None, 2, ["AGENTTUI_TOKEN"]),
    "tui-token-argument": (["--url", "http://127.0.0.1:1", "--token", "secret"], None, 2,
                           ["AGENTTUI_TOKEN"]),
    "ask-unknown-option": (["ask", "--frobnicate"], None, 2, ["--frobnicate"]),
    "login-no-url": (["login", "--code", "ABCDE-FGHIJ"], None, 2, ["URL"]),
    "login-not-a-url": (["login", "ftp://example.org", "--code", "ABCDE-FGHIJ"], None, 2,
                        ["not a daemon URL"]),
    "login-token-argument": (["login", "http://127.0.0.1:1", "--token", "secret"], None, 2,
                             ["--token -"]),
    "login-bad-fingerprint": (["login", "https://127.0.0.1:1", "--code", "ABCDE-FGHIJ",
                               "--fingerprint", "bogus"], None, 2, ["fingerprint"]),
    "no-such-command": (["frobnicate"], None, 2, ["frobnicate"]),
}


@pytest.mark.parametrize("case", sorted(AGENTTUI_OFFLINE_CASES))
def test_agenttui_answers_bad_input_with_one_line(case: str, tmp_path: Path) -> None:
    args, token, code, words = AGENTTUI_OFFLINE_CASES[case]
    result = run("agenttui", *[arg.format(unreachable=free_port()) for arg in args],
                 home=tmp_path, env=None if token is None else {"AGENTTUI_TOKEN": token})
    assert_one_line(result, "agenttui", code, *words)
    assert "secret" not in result.stderr, "the refused token was echoed back"


def test_a_token_stored_for_another_daemon_is_not_sent_and_the_line_says_why(
        tmp_path: Path) -> None:
    config = tmp_path / "agenttui" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('url = "https://desk:8740"\ntoken = "agd_secret"\n', "utf-8")
    result = run("agenttui", "ask", "--url", "http://127.0.0.1:1", "hi", home=tmp_path)
    assert_one_line(result, "agenttui", 2, "stored token is for https://desk:8740",
                    "AGENTTUI_TOKEN")
    assert "agd_secret" not in result.stderr


async def test_agenttui_answers_refused_input_with_one_line(
        spawn_daemon, pool: asyncpg.Pool, tmp_path: Path) -> None:
    daemon = spawn_daemon()
    await daemon.wait_ready(timeout=60)
    token, _ = await create_device_token(pool, account="acme", device="desk")
    url = daemon.url
    cases = [
        (["ask", "--url", url, "hi"], "agd_wrong", 4, ["refused the token"]),
        (["models", "--url", url], "agd_wrong", 4, ["unknown or revoked"]),
        (["ask", "--url", url, "--conversation", str(uuid.UUID(int=7)), "hi"], token, 2,
         ["not found"]),
        (["ask", "--url", url, "--model", "nope:nothing", "hi"], token, 2, ["nope:nothing"]),
        (["ask", "--url", url, "--param", "tokens=-1", "hi"], token, 2, ["tokens"]),
        (["login", url, "--code", "ABCDE-FGHIJ"], None, 4, ["refused the pairing code"]),
    ]
    for args, given, code, words in cases:
        env = None if given is None else {"AGENTTUI_TOKEN": given}
        assert_one_line(run("agenttui", *args, home=tmp_path, env=env), "agenttui", code,
                        *words)
