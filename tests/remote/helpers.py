"""What the remote-access tests share: daemons that may speak TLS or listen on another address
of this machine, the `agentd`/`agenttui` commands as subprocesses, and raw sockets.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.daemon import Daemon, free_port, launch, poll_until, tracked_daemons

CLI_TIMEOUT_S = 120.0


class RemoteDaemon(Daemon):
    """A daemon with its own data directory (its certificate lives there), maybe serving TLS.

    Its HTTP client verifies the certificate for real: the daemon's own file is the only trust
    anchor, and the host name must match the certificate (an address in its SANs).
    """

    def __init__(self, *, tls: bool, data_dir: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tls = tls
        self.data_dir = data_dir
        self.extra_env.setdefault("AGENTD_DATA_DIR", str(data_dir))
        if tls:
            self.extra_env.setdefault("AGENTD_TLS", "on")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @property
    def cert_path(self) -> Path:
        return self.data_dir / "tls" / "agentd.crt"

    def ssl_context(self) -> ssl.SSLContext:
        if self.cert_path.exists():
            return ssl.create_default_context(cafile=str(self.cert_path))
        return ssl.create_default_context()  # not made yet: every handshake fails (retried)

    def client(self, *, timeout: float = 5.0, **kwargs: Any) -> httpx.AsyncClient:
        if self.tls:
            kwargs.setdefault("verify", self.ssl_context())
        return super().client(timeout=timeout, **kwargs)

    def cli_env(self) -> dict[str, str]:
        """The environment `agentd` commands need to act on this daemon's installation."""
        env = self.environment()
        env.pop("PYTHONUNBUFFERED", None)
        return env


class SpawnRemote(Protocol):
    def __call__(self, *, tls: bool = ..., host: str = ..., port: int | None = ...,
                 data_dir: Path | None = ..., name: str | None = ...,
                 env: Mapping[str, str] | None = ..., args: Sequence[str] = ...,
                 **settings: Any) -> RemoteDaemon: ...


@pytest.fixture
def spawn_remote(request: pytest.FixtureRequest, dsn: str,
                 tmp_path: Path) -> Iterator[SpawnRemote]:
    """Start daemons on this test's database (each killed when the test ends)."""
    daemons = tracked_daemons(request)

    def spawn(*, tls: bool = False, host: str = "127.0.0.1", port: int | None = None,
              data_dir: Path | None = None, name: str | None = None,
              env: Mapping[str, str] | None = None, args: Sequence[str] = (),
              **settings: Any) -> RemoteDaemon:
        label = name or f"agentd-{len(daemons) + 1}"
        return launch(daemons, RemoteDaemon, dsn=dsn, tmp_path=tmp_path, name=label, env=env,
                      args=args, settings=settings, tls=tls, host=host, port=port,
                      data_dir=data_dir or tmp_path / label / "data")

    try:
        yield spawn
    finally:
        for daemon in daemons:
            daemon.close()


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (None if it has none)."""
    candidates: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.123", 9))  # a UDP "connect" sends nothing: it picks a route
            candidates.append(probe.getsockname()[0])
        except OSError:
            pass
    try:
        candidates += [info[4][0] for info in socket.getaddrinfo(
            socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    for address in candidates:
        if ipaddress.ip_address(address).is_loopback:
            continue
        try:
            free_port(address)  # can we bind it (as the daemon will)?
        except OSError:
            continue
        return address
    return None


def metric(scraped: str, name: str) -> float:
    """The value of the first sample called `name` in a /metrics answer."""
    return next(sample.value for family in text_string_to_metric_families(scraped)
                for sample in family.samples if sample.name == name)


async def only_this_connection_open(client: httpx.AsyncClient) -> None:
    """Wait until the daemon counts no connection open but the one `client` asks it on (and
    keeps open). A closed connection's place is given back once the daemon has read its close,
    which can come after the next connections are accepted (over TLS the close is an exchange):
    a test filling the cap right after a request could see its last connection refused and its
    probe served."""
    async def settled() -> bool:
        return metric((await client.get("/metrics")).text, "agentd_connections_open") == 1

    await poll_until(settled, 10, interval=0.05, what="no other connection open")


def run_cli(program: str, *args: str, env: Mapping[str, str],
            stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`agentd …` or `agenttui …` as a script runs it (no terminal: a new session)."""
    return subprocess.run([sys.executable, "-m", program, *args], input=stdin,
                          stdin=None if stdin is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                          env=dict(env), start_new_session=True, check=False)


def client_env(config_dir: Path) -> dict[str, str]:
    """agenttui's environment with a private config dir (and no inherited settings)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AGENTTUI_", "AGENTD_"))}
    env["AGENTTUI_CONFIG_DIR"] = str(config_dir)
    env["AGENTTUI_STATE_DIR"] = str(config_dir / "state")
    env["AGENTTUI_CACHE_DIR"] = str(config_dir / "cache")
    return env


async def socket_closed(reader: asyncio.StreamReader, within: float) -> bytes:
    """Read until the peer closes (EOF or reset); what it sent. Fails after `within` s."""
    received = b""
    async with asyncio.timeout(within):
        while True:
            try:
                chunk = await reader.read(4096)
            except ConnectionResetError:
                return received
            if not chunk:
                return received
            received += chunk
