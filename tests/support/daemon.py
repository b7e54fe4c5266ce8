"""Real agentd daemons as subprocesses, for tests that drive them over HTTP and with signals.

Loaded as a plugin (tests/conftest.py): the `spawn_daemon` fixture and the report hook that
attaches every daemon's log to a failed test are available to every tier.

Each daemon runs `python -m agentd serve` in its own process group with an isolated environment
(no inherited AGENTD_* settings, private config/data dirs) and logs to a file under the test's
tmp dir; a failing test's report carries every daemon's log. States are polled against a
deadline (`poll_until`), never slept for.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
import pytest

T = TypeVar("T")

DEFAULT_READY_TIMEOUT_S = 30.0
DEFAULT_EXIT_TIMEOUT_S = 15.0
LOG_TAIL_CHARS = 20_000
# Settings for a daemon whose test looks at something other than admission by load (load.py):
# on a machine busy with other work, a moment of event-loop lag over the default 250 ms would
# queue a turn that an idle daemon starts in the commit that wrote it.
ADMIT_ANY_LOAD = {"max_loop_lag_ms": 60_000, "max_pool_wait_ms": 60_000}
_DAEMONS_ATTR = "_agentd_daemons"


async def poll_until(predicate: Callable[[], Awaitable[T] | T],
                     timeout: float,  # noqa: ASYNC109
                     interval: float = 0.02, *, what: str | None = None) -> T:
    """Call `predicate` (awaiting what it returns, if awaitable: a query, or a plain check of
    state in this process) until it returns something truthy and return that; fail at the
    deadline.

    The predicate is always evaluated at least once, and once more after the deadline passed,
    so a slow poll never fails a state that was reached.
    """
    deadline = time.monotonic() + timeout
    while True:
        expired = time.monotonic() >= deadline
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if expired:
            raise AssertionError(f"timed out after {timeout:g}s waiting for "
                                 f"{what or getattr(predicate, '__name__', 'a state')}")
        await asyncio.sleep(interval)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the daemon binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def settings_env(**settings: Any) -> dict[str, str]:
    """`tick_s=60` -> `{"AGENTD_TICK_S": "60"}`: the daemon's AGENTD_* spelling of a setting."""
    return {f"AGENTD_{key.upper()}": str(value) for key, value in settings.items()}


def with_user(dsn: str, user: str, password: str | None = None) -> str:
    """The same DSN (TCP or unix-socket URL) connecting as another role."""
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    login = quote(user, safe="")
    if password is not None:
        login += ":" + quote(password, safe="")
    return urlunsplit((parts.scheme, f"{login}@{host}", parts.path, parts.query,
                       parts.fragment))


class Daemon:
    """One `agentd serve` process: start it, probe it over HTTP, signal it, read its log."""

    def __init__(self, *, dsn: str | None, workdir: Path, name: str = "agentd",
                 env: Mapping[str, str] | None = None, args: Sequence[str] = (),
                 host: str = "127.0.0.1", port: int | None = None) -> None:
        self.name = name
        self.dsn = dsn
        self.host = host
        self.port = port or free_port(host)
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self.extra_env = dict(env or {})
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.worker_id: str | None = None
        self._log: IO[bytes] | None = None

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "agentd", "serve", "--listen", f"{self.host}:{self.port}"]
        if self.dsn is not None:
            cmd += ["--dsn", self.dsn]
        elif "--data-dir" not in self.args:
            cmd += ["--data-dir", str(self.workdir / "pgdata")]
        return cmd + self.args

    def environment(self) -> dict[str, str]:
        """The parent's environment minus its AGENTD_* settings, with private user dirs."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
        home = self.workdir / "home"
        for var, sub in (("XDG_CONFIG_HOME", "config"), ("XDG_DATA_HOME", "data"),
                         ("XDG_STATE_HOME", "state"), ("XDG_CACHE_HOME", "cache"),
                         ("XDG_RUNTIME_DIR", "run")):
            path = home / sub
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            env[var] = str(path)
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("NOTIFY_SOCKET", None)  # never report readiness to a real supervisor
        # One process unless a test asks for workers: signals and pids reach the daemon itself.
        env["AGENTD_WORKERS"] = "1"
        env.update(self.extra_env)
        return env

    def start(self) -> Daemon:
        assert self.proc is None, f"{self.name} was already started"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, env=self.environment(), cwd=self.workdir,
            start_new_session=True,  # own process group: signals and cleanup reach only it
            preexec_fn=_hangup_as_from_a_terminal)
        return self

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def process_state(self) -> str | None:
        """The kernel's one-letter state (R, S, T = stopped, Z...) or None once gone (Linux)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return None
        return stat.rpartition(")")[2].split()[0]

    # -- signals --------------------------------------------------------------------------

    def send_signal(self, signum: int) -> None:
        assert self.running, f"{self.name} is not running (exit code {self.returncode})"
        os.kill(self.pid, signum)

    def terminate(self) -> None:
        """SIGTERM: the daemon drains and exits on its own."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, nothing runs after it."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)

    def stop(self) -> None:
        """SIGSTOP: frozen mid-instruction, as in a long GC pause or a suspended VM.

        Returns once the kernel reports the process stopped (signal delivery is asynchronous).
        """
        self.signal_group(signal.SIGSTOP)
        self._await_state(lambda state: state == "T", "stopped")

    def cont(self) -> None:
        """SIGCONT: resumes a stopped process; returns once it is no longer stopped."""
        self.signal_group(signal.SIGCONT)
        self._await_state(lambda state: state != "T", "resumed")

    def signal_group(self, signum: int) -> None:
        """A signal to the daemon's whole process group, its workers too when it runs several:
        as a terminal delivers its Ctrl-C (SIGINT), or systemd's default KillMode its stop."""
        assert self.running, f"{self.name} is not running (exit code {self.returncode})"
        os.killpg(self.pid, signum)

    def _await_state(self, reached: Callable[[str | None], bool], what: str,
                     timeout: float = 5.0) -> None:
        # Blocking on purpose: the kernel settles this within microseconds, and a test that
        # signals a daemon must not observe anything before the signal took effect.
        if not Path("/proc/self/stat").exists():
            return
        deadline = time.monotonic() + timeout
        while not reached(self.process_state()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} was not {what} after {timeout:g}s")
            time.sleep(0.001)

    async def wait_exit(self, timeout: float = DEFAULT_EXIT_TIMEOUT_S) -> int:  # noqa: ASYNC109
        """The exit code once the process is gone (negative: killed by that signal)."""
        assert self.proc is not None, f"{self.name} was never started"
        proc = self.proc
        try:
            await poll_until(lambda: _returned(proc), timeout, what=f"{self.name} to exit")
        except AssertionError:
            raise AssertionError(f"{self.name} did not exit within {timeout:g}s\n"
                                 f"{self.log_tail()}") from None
        assert proc.returncode is not None
        return proc.returncode

    # -- HTTP -----------------------------------------------------------------------------

    def client(self, *, timeout: float | httpx.Timeout = 5.0,
               **kwargs: Any) -> httpx.AsyncClient:
        """An HTTP client for this daemon (no proxies from the environment)."""
        return httpx.AsyncClient(base_url=self.url, timeout=timeout, trust_env=False, **kwargs)

    async def request(self, method: str, path: str, *, timeout: float = 5.0,  # noqa: ASYNC109
                      **kwargs: Any) -> httpx.Response:
        async with self.client(timeout=timeout) as client:
            return await client.request(method, path, **kwargs)

    async def healthz(self, *, timeout: float = 5.0) -> dict[str, Any]:  # noqa: ASYNC109
        response = await self.request("GET", "/healthz", timeout=timeout)
        response.raise_for_status()
        return response.json()

    async def readyz(self, *, timeout: float = 5.0) -> dict[str, Any]:  # noqa: ASYNC109
        """The readiness body ({status, database, hub, draining, ...}), ready or not."""
        response = await self.request("GET", "/readyz", timeout=timeout)
        assert response.status_code in (200, 503), response.text
        return response.json()

    async def wait_ready(
            self, timeout: float = DEFAULT_READY_TIMEOUT_S,  # noqa: ASYNC109
    ) -> dict[str, Any]:
        """Poll /readyz until the daemon is ready; fail at once (with its log) if it exits."""

        async def ready() -> dict[str, Any] | None:
            if not self.running:
                raise AssertionError(f"{self.name} exited with {self.returncode} before it "
                                     f"was ready\n{self.log_tail()}")
            try:
                body = await self.readyz(timeout=1.0)
            except httpx.TransportError:
                return None
            return body if body.get("status") == "ready" else None

        try:
            body = await poll_until(ready, timeout, interval=0.05, what=f"{self.name} ready")
        except AssertionError as exc:
            if "before it was ready" in str(exc):
                raise
            raise AssertionError(f"{exc}\n{self.log_tail()}") from None
        # Only a loopback client is told the worker id (a daemon on another address keeps it).
        self.worker_id = (await self.healthz()).get("worker_id")
        return body

    # -- log ------------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        text = self.log_text()
        cut = text[-chars:]
        header = f"--- {self.name} (pid {self.proc.pid if self.proc else '-'}, " \
                 f"{self.url}) log {self.log_path}"
        return f"{header}{' (tail)' if len(cut) < len(text) else ''} ---\n{cut}"

    async def wait_for_log(self, text: str, timeout: float) -> None:  # noqa: ASYNC109
        async def logged() -> bool:
            return text in self.log_text()

        await poll_until(logged, timeout, what=f"{text!r} in {self.name}'s log")

    # -- cleanup --------------------------------------------------------------------------

    def close(self) -> None:
        """Kill whatever is left (stopped or not) and reap it. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None


def _hangup_as_from_a_terminal() -> None:
    """SIGHUP at its default, as a shell gives it: a test runner started under nohup passes it
    on ignored, and agentd keeps an ignored SIGHUP ignored."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


async def _returned(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is not None


D = TypeVar("D", bound="Daemon")


class SpawnDaemon(Protocol):
    def __call__(self, *, dsn: str | None = ..., name: str | None = ...,
                 env: Mapping[str, str] | None = ..., args: Sequence[str] = ...,
                 **settings: Any) -> Daemon: ...


def launch(daemons: list[Daemon], kind: type[D], *, dsn: str | None, tmp_path: Path,
           name: str | None, env: Mapping[str, str] | None, args: Sequence[str],
           settings: Mapping[str, Any], **daemon_kwargs: Any) -> D:
    """Start a `kind` daemon in `tmp_path/<name>` and track it in `daemons` (for the report
    hook and the cleanup): the one launcher every spawning fixture goes through."""
    label = name or f"agentd-{len(daemons) + 1}"
    daemon = kind(dsn=dsn, workdir=tmp_path / label, name=label,
                  env={**settings_env(**settings), **(env or {})}, args=args, **daemon_kwargs)
    daemons.append(daemon)
    daemon.start()
    return daemon


def tracked_daemons(request: pytest.FixtureRequest) -> list[Daemon]:
    """The list of this test's daemons (shared by every spawning fixture it uses)."""
    daemons: list[Daemon] | None = getattr(request.node, _DAEMONS_ATTR, None)
    if daemons is None:
        daemons = []
        setattr(request.node, _DAEMONS_ATTR, daemons)
    return daemons


@pytest.fixture
def spawn_daemon(request: pytest.FixtureRequest, dsn: str,
                 tmp_path: Path) -> Iterator[SpawnDaemon]:
    """Start daemons on this test's database: `spawn_daemon(tick_s=60)` -> a started Daemon.

    Keyword settings become AGENTD_* variables; `env` adds raw variables; `dsn=None` runs the
    daemon's own embedded PostgreSQL. Every daemon is killed when the test ends.
    """
    daemons = tracked_daemons(request)
    default_dsn = dsn

    def spawn(*, dsn: str | None = default_dsn, name: str | None = None,
              env: Mapping[str, str] | None = None, args: Sequence[str] = (),
              **settings: Any) -> Daemon:
        return launch(daemons, Daemon, dsn=dsn, tmp_path=tmp_path, name=name, env=env,
                      args=args, settings=settings)

    try:
        yield spawn
    finally:
        for daemon in daemons:
            daemon.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Attach every daemon's log to the report of a failed test."""
    report = yield
    if report.failed:
        for daemon in getattr(item, _DAEMONS_ATTR, ()):
            report.sections.append((f"agentd log: {daemon.name}", daemon.log_tail()))
    return report
