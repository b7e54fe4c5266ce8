"""A real PgBouncer (the distribution's program) in transaction mode, in a temp dir, in front of
the test's PostgreSQL: `Bouncer(upstream_dsn, workdir).start()` -> a DSN through it.

PgBouncer refuses to run as root: then it runs as `postgres` (or `nobody`) with its config in a
folder of that account's own. Tests skip, saying why, when the program is missing.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import pytest

from tests.support.daemon import free_port


def pgbouncer_program() -> str:
    """The pgbouncer binary, or skip the test (with how to install it)."""
    found = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)),
        None)
    if found is None:
        pytest.skip("pgbouncer is not installed (Debian/Ubuntu: apt-get install pgbouncer; "
                    ".ci/run installs it when it can)")
    return found


def _run_as() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    pytest.skip("pgbouncer refuses to run as root and there is no account to run it as")


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class Bouncer:
    """One pgbouncer process: pool_mode = transaction, any client login as the upstream user."""

    def __init__(self, upstream_dsn: str, workdir: Path) -> None:
        self.upstream = urlsplit(upstream_dsn)
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "pgbouncer.log"
        self._own_dir: Path | None = None

    def _config(self) -> str:
        parts = self.upstream
        query = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p)
        host = unquote(query.get("host") or parts.hostname or "127.0.0.1")
        port = str(parts.port or query.get("port") or 5432)
        user = unquote(parts.username or "postgres")
        target = [f"host={_quote(host)}", f"port={port}", f"user={_quote(user)}"]
        password = unquote(parts.password) if parts.password else None
        if password is None and "passfile" in query:
            # libpq's format (host:port:db:user:password); the embedded server's has one line.
            line = Path(unquote(query["passfile"])).read_text().strip().splitlines()[0]
            password = line.split(":", 4)[4]
        if password:
            target.append(f"password={_quote(password)}")
        return "\n".join([
            "[databases]",
            "* = " + " ".join(target),
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = any",
            "pool_mode = transaction",
            "max_client_conn = 500",
            "default_pool_size = 10",
            # A client that sends session settings at startup must still get in (the keeper
            # and the migrator send timeouts; a transaction pooler cannot keep them anyway).
            "ignore_startup_parameters = extra_float_digits, lock_timeout, statement_timeout, "
            "idle_in_transaction_session_timeout",
            "server_reset_query =",
            "",
        ])

    def dsn(self, database: str | None = None) -> str:
        """The upstream DSN's database, through the bouncer (no password: auth_type = any)."""
        name = database or self.upstream.path.lstrip("/") or "postgres"
        return urlunsplit(("postgresql", f"bouncer@127.0.0.1:{self.port}", f"/{name}", "", ""))

    def start(self) -> Bouncer:
        program = pgbouncer_program()
        user = _run_as()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "pgbouncer.ini"
        config.write_text(self._config())
        command = [program, str(config)]
        if user is not None:
            # Its config in a folder of its own under the system temp dir, owned by `user`
            # (the test's tmp dir may be one only root can enter).
            account = pwd.getpwnam(user)
            own = Path(tempfile.mkdtemp(prefix="agentd-pgbouncer-"))
            self._own_dir = own
            config = own / "pgbouncer.ini"
            config.write_text(self._config())
            for path in (own, config):
                os.chown(path, account.pw_uid, account.pw_gid)
            config.chmod(0o600)
            command = [program, "-u", user, str(config)]
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return self

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # SIGTERM: immediate shutdown
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
