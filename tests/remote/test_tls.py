"""TLS and pinning end to end: a daemon serving HTTPS, `agentd pair`, `agenttui login` and
`agenttui ask` as real processes over real handshakes, and a changed certificate refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import pty
import re
import socket
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import asyncpg
import httpx
import psutil
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from agentd.fingerprints import fingerprint
from agentd.providers.demo import expected_answer
from agenttui.client import AgentClient, CertificateMismatch, ConnectionState, ConnectionStatus
from tests.remote.helpers import (
    CLI_TIMEOUT_S,
    RemoteDaemon,
    SpawnRemote,
    client_env,
    non_loopback_address,
    run_cli,
)
from tests.support.daemon import free_port, poll_until

LOGIN_LINE = re.compile(r"agenttui login (\S+) --code (\S+) --fingerprint (\S+)")


def served_fingerprint(daemon: RemoteDaemon) -> str:
    cert = x509.load_pem_x509_certificate(daemon.cert_path.read_bytes())
    return fingerprint(cert.public_bytes(serialization.Encoding.DER))


def agentd_pair(daemon: RemoteDaemon, dsn: str, device: str) -> tuple[str, str, str]:
    """`agentd pair` on the daemon's host: (url, code, fingerprint) from the line it prints."""
    result = run_cli("agentd", "pair", "--dsn", dsn, "--listen", f"{daemon.host}:{daemon.port}",
                     "--account", "alice", "--device", device, env=daemon.cli_env())
    assert result.returncode == 0, result.stderr
    match = LOGIN_LINE.search(result.stdout)
    assert match, result.stdout
    url, code, pin = match.groups()
    return url, code, pin


async def code_spent(pool: asyncpg.Pool) -> bool:
    return await pool.fetchval("SELECT count(*) FROM pairing WHERE used_at IS NOT NULL") > 0


async def test_pair_login_and_ask_over_https_then_a_new_certificate_is_refused(
        spawn_remote: SpawnRemote, dsn: str, pool: asyncpg.Pool, tmp_path: Path) -> None:
    port = free_port()
    first = spawn_remote(tls=True, port=port, name="first")
    await first.wait_ready()
    url = first.url

    # The certificate made on first start: ECDSA P-256, key 0600, the addresses in its SANs.
    cert = x509.load_pem_x509_certificate(first.cert_path.read_bytes())
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"
    key_path = first.cert_path.with_name("agentd.key")
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    assert socket.gethostname() in sans.get_values_for_type(x509.DNSName)
    # A real handshake (the client verifies against the daemon's own certificate) at TLS ≥ 1.2.
    context = first.ssl_context()
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context,
                                              server_hostname="127.0.0.1")
    assert writer.get_extra_info("ssl_object").version() in ("TLSv1.2", "TLSv1.3")
    writer.close()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False) as plain:
        with pytest.raises(httpx.TransportError):  # plain HTTP gets no answer on a TLS port
            await plain.get("/healthz")

    paired_url, code, pin = agentd_pair(first, dsn, "laptop")
    assert paired_url == url and pin == served_fingerprint(first)

    laptop = client_env(tmp_path / "laptop")
    # Off a terminal and without --fingerprint, nothing is trusted and nothing is sent.
    unasked = run_cli("agenttui", "login", url, "--code", code, env=laptop)
    assert unasked.returncode == 2 and "--fingerprint" in unasked.stderr
    assert pin in unasked.stderr  # it shows what it saw, to compare
    # A wrong pin: refused before the code leaves the machine (the code is still good).
    wrong = "SHA256:" + "A" * 43
    refused = run_cli("agenttui", "login", url, "--code", code, "--fingerprint", wrong,
                      env=laptop)
    assert refused.returncode == 4 and pin in refused.stderr and wrong in refused.stderr
    assert not await code_spent(pool)
    # `ca` (no pin, a CA must vouch for the certificate) does not take a self-signed one either.
    no_ca = run_cli("agenttui", "login", url, "--code", code, "--fingerprint", "ca", env=laptop)
    assert no_ca.returncode == 4 and "certificate verify failed" in no_ca.stderr, no_ca.stderr
    assert not await code_spent(pool)
    assert not (tmp_path / "laptop" / "config.toml").exists()

    login = run_cli("agenttui", "login", url, "--code", code, "--fingerprint", pin, env=laptop)
    assert login.returncode == 0, login.stderr
    assert "as device 'laptop' of account 'alice'" in login.stdout
    config_path = tmp_path / "laptop" / "config.toml"
    assert stat.S_IMODE(config_path.stat().st_mode) == 0o600
    config = tomllib.loads(config_path.read_text())
    assert (config["url"], config["fingerprint"], config["device"]) == (url, pin, "laptop")
    assert config["token"].startswith("agd_")
    assert await code_spent(pool)

    asked = run_cli("agenttui", "ask", "--param", "tokens=6", "hello over tls", env=laptop)
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout.strip() == expected_answer("demo", "hello over tls", 6)

    # Another daemon with another certificate answers on the same URL.
    first.terminate()
    await first.wait_exit()
    second = spawn_remote(tls=True, port=port, name="second")
    await second.wait_ready()
    assert second.url == url
    new_pin = served_fingerprint(second)
    assert new_pin != pin

    refused = run_cli("agenttui", "ask", "--param", "tokens=3", "hello again", env=laptop)
    assert refused.returncode == 4
    assert pin in refused.stderr and new_pin in refused.stderr
    assert f"agenttui login {url} --fingerprint {new_pin}" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not await pool.fetchval("SELECT count(*) FROM message WHERE content = 'hello again'")

    # The TUI's own client (streams and reconnects included) refuses it too, and gives up.
    async with AgentClient(url, config["token"], fingerprint=pin, trust_env=False) as client:
        with pytest.raises(CertificateMismatch):
            await client.list_conversations()
        states: list[ConnectionStatus] = []
        with pytest.raises(CertificateMismatch):
            async with asyncio.timeout(30):
                async for item in client.conversation_events(str(await _any_conversation(
                        pool))):
                    if isinstance(item, ConnectionStatus):
                        states.append(item)
        assert states[-1].state == ConnectionState.CLOSED and new_pin in (states[-1].error or "")

    # Re-pinning on purpose (the command the error names) attaches to the new server.
    repinned = run_cli("agenttui", "login", url, "--fingerprint", new_pin, env=laptop)
    assert repinned.returncode == 0, repinned.stderr
    again = run_cli("agenttui", "ask", "--param", "tokens=3", "hello again", env=laptop)
    assert again.returncode == 0, again.stderr


async def _any_conversation(pool: asyncpg.Pool) -> str:
    return str(await pool.fetchval("SELECT id FROM conversation LIMIT 1"))


@pytest.mark.parametrize("code_asked", [False, True], ids=["code-argument", "code-asked"])
async def test_trust_on_first_use_asks_on_a_terminal(
        spawn_remote: SpawnRemote, dsn: str, tmp_path: Path, code_asked: bool) -> None:
    """`--code -` asks for the code instead: the command line, which every local user can
    read while the trust prompt waits, never holds it."""
    daemon = spawn_remote(tls=True)
    await daemon.wait_ready()
    url, code, pin = agentd_pair(daemon, dsn, "tablet")
    shown, code_ = await asyncio.to_thread(_login_on_a_terminal, url, code,
                                           client_env(tmp_path / "tablet"), code_asked)
    assert code_ == 0, shown.decode()
    assert pin.encode() in shown  # it showed the fingerprint it pinned, to compare with `pair`
    config = tomllib.loads((tmp_path / "tablet" / "config.toml").read_text())
    assert config["fingerprint"] == pin and config["device"] == "tablet"


def _login_on_a_terminal(url: str, code: str, env: dict[str, str],
                         code_asked: bool = False) -> tuple[bytes, int]:
    """`agenttui login URL --code CODE` (or `--code -`, typing the code when asked) on a
    pseudo-terminal, answering `y` when asked to trust."""
    primary, secondary = pty.openpty()
    argv = [sys.executable, "-m", "agenttui", "login", url, "--code", "-" if code_asked else code]
    proc = subprocess.Popen(argv, stdin=secondary, stdout=secondary, stderr=secondary, env=env,
                            start_new_session=True)
    os.close(secondary)
    try:
        shown = b""
        if code_asked:
            shown += _read_until(primary, b"Pairing code", CLI_TIMEOUT_S)
            assert code not in " ".join(psutil.Process(proc.pid).cmdline())
            os.write(primary, code.encode() + b"\n")
        shown += _read_until(primary, b"[y/N]", CLI_TIMEOUT_S)
        os.write(primary, b"y\n")
        shown += _read_until(primary, None, CLI_TIMEOUT_S)
        return shown, proc.wait(timeout=CLI_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        os.close(primary)


def _read_until(fd: int, marker: bytes | None, timeout: float) -> bytes:
    """Read a pseudo-terminal until `marker` shows (None: until the other side closes)."""
    out = b""
    deadline = time.monotonic() + timeout
    while marker is None or marker not in out:
        assert time.monotonic() < deadline, f"no {marker!r} in {out!r}"
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the process closed the terminal
            return out
        if not chunk:
            return out
        out += chunk
    return out


async def test_another_address_serves_https_unless_plain_http_is_asked_for_by_name(
        spawn_remote: SpawnRemote, tmp_path: Path) -> None:
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to listen on")
    # By default (tls = auto) a non-loopback address is HTTPS.
    daemon = spawn_remote(tls=True, host=address, env={"AGENTD_TLS": "auto"})
    await daemon.wait_ready()
    assert (await daemon.healthz()) == {"status": "ok"}  # not loopback: no worker id

    # tls = off there is refused at start, naming the setting that would allow it.
    refused = run_cli("agentd", "serve", "--dsn", "postgresql://unused@127.0.0.1:1/x",
                      "--listen", f"{address}:{free_port(address)}",
                      env={**daemon.cli_env(), "AGENTD_TLS": "off"})
    assert refused.returncode == 2 and "insecure_http" in refused.stderr

    # --insecure-http says so at every start.
    plain = spawn_remote(host=address, args=["--insecure-http"], name="plain")
    await plain.wait_ready()
    await plain.wait_for_log("PLAIN HTTP on a non-loopback address", 10)


async def test_pairing_over_plain_http_and_a_token_on_stdin(
        spawn_remote: SpawnRemote, dsn: str, pool: asyncpg.Pool, tmp_path: Path) -> None:
    daemon = spawn_remote()
    await daemon.wait_ready()
    result = run_cli("agentd", "pair", "--dsn", dsn, "--listen", f"127.0.0.1:{daemon.port}",
                     "--account", "alice", "--device", "script", env=daemon.cli_env())
    assert result.returncode == 0, result.stderr
    assert "--fingerprint" not in result.stdout  # plain HTTP: nothing to pin
    assert "cannot reach" in result.stderr  # loopback only: said plainly
    minted = await pool.fetchval("SELECT count(*) FROM pairing")
    assert minted == 1

    made = run_cli("agentd", "token", "create", "--dsn", dsn, "--account", "alice",
                   "--device", "ci", env=daemon.cli_env())
    token = made.stdout.strip()
    env = client_env(tmp_path / "ci")
    stored = run_cli("agenttui", "login", daemon.url, "--token", "-", env=env,
                     stdin=token + "\n")
    assert stored.returncode == 0, stored.stderr
    assert token not in stored.stdout + stored.stderr
    assert tomllib.loads((tmp_path / "ci" / "config.toml").read_text())["token"] == token


async def test_the_tui_over_pinned_https_says_so_in_its_status_line(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from agentd.accounts import create_device_token
    from agenttui.app import make_app
    from agenttui.settings import Settings as TuiSettings

    for name in ("CONFIG", "CACHE", "STATE"):
        monkeypatch.setenv(f"AGENTTUI_{name}_DIR", str(tmp_path / name.lower()))
    daemon = spawn_remote(tls=True)
    await daemon.wait_ready()
    pin = served_fingerprint(daemon)
    token, _ = await create_device_token(pool, account="alice", device="desk")
    client = AgentClient(daemon.url, token, fingerprint=pin, trust_env=False)
    app = make_app(TuiSettings(url=daemon.url, token=token, fingerprint=pin), client,
                   close_client=True)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press(*"hello", "enter")  # opens a conversation, so the bar shows the link
        deadline = time.monotonic() + 30
        while not ("encrypted · pinned" in app.main.bar.plain and "● live" in
                   app.main.bar.plain):
            assert time.monotonic() < deadline, app.main.bar.plain
            await pilot.pause(0.05)
        assert f"🔒 encrypted · pinned {pin[:15]}…" in app.main.bar.plain


async def test_the_local_client_follows_its_daemon_to_tls(
        spawn_remote: SpawnRemote, pool: asyncpg.Pool, tmp_path: Path) -> None:
    from agentd.accounts import create_device_token

    port = free_port()
    token, _ = await create_device_token(pool, account="local", device="this machine")
    local_config = tmp_path / "local" / "home" / "config" / "agenttui" / "config.toml"
    local_config.parent.mkdir(parents=True)
    local_config.write_text(f'url = "http://127.0.0.1:{port}"\ntoken = "{token}"\n'
                            'theme = "nord"\n')
    daemon = spawn_remote(tls=True, port=port, name="local")
    await daemon.wait_ready()

    async def repinned() -> dict[str, str] | None:
        config = tomllib.loads(local_config.read_text())
        return config if config.get("fingerprint") else None

    config = await poll_until(repinned, 10, what="the local client's config to follow")
    assert config == {"url": f"https://127.0.0.1:{port}", "token": token,
                      "fingerprint": served_fingerprint(daemon), "theme": "nord"}
    env = client_env(local_config.parent.parent / "agenttui")
    asked = run_cli("agenttui", "ask", "--param", "tokens=2", "still here?", env=env)
    assert asked.returncode == 0, asked.stderr


async def test_doctor_on_a_running_install_finds_its_daemon_not_a_busy_address(
        spawn_remote: SpawnRemote, dsn: str) -> None:
    """`agentd doctor` beside the daemon it checks (over TLS here) passes the listen address:
    it used to fail it as busy, so doctor exited 1 on every healthy running install. Anything
    else holding the address still fails it."""
    daemon = spawn_remote(tls=True)
    await daemon.wait_ready()
    env = {**daemon.cli_env(), "AGENTD_LISTEN": f"127.0.0.1:{daemon.port}"}
    doctor = run_cli("agentd", "doctor", "--dsn", dsn, env=env)
    assert "[ok  ] listen address: 127.0.0.1:" in doctor.stdout, doctor.stdout
    assert "served by a running agentd" in doctor.stdout
    with socket.socket() as other:  # not an agentd: nothing answers its /healthz
        other.bind(("127.0.0.1", 0))
        other.listen()
        env["AGENTD_LISTEN"] = f"127.0.0.1:{other.getsockname()[1]}"
        doctor = run_cli("agentd", "doctor", "--dsn", dsn, env=env)
    assert "[FAIL] listen address:" in doctor.stdout and "already in use" in doctor.stdout
    assert doctor.returncode == 1
    # On another address of this machine, where the daemon does not see doctor as loopback.
    address = non_loopback_address()
    if address is None:
        return  # what follows needs one; the rest of the test has run
    other_daemon = spawn_remote(tls=True, host=address, name="on-another-address")
    await other_daemon.wait_ready()
    env["AGENTD_LISTEN"] = f"{address}:{other_daemon.port}"
    doctor = run_cli("agentd", "doctor", "--dsn", dsn, env=env)
    assert "served by a running agentd" in doctor.stdout, doctor.stdout
