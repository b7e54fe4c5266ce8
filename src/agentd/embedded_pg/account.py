"""The unprivileged account the server runs as when agentd runs as root: never root, never a
shared account such as `nobody`; created (locked, no shell) when none fits."""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agentd.embedded_pg.errors import EmbeddedPgError

log = logging.getLogger("agentd.embedded_pg")

# As root, the server runs as AGENTD_PG_USER, else `postgres`, else this account, which agentd
# creates (locked, no shell). Never `nobody`: every daemon that runs as nobody could read the data.
CREATED_ACCOUNT = "agentd-pg"
DEFAULT_ACCOUNTS: tuple[str, ...] = ("postgres",)
SHARED_ACCOUNTS = frozenset({"nobody"})


@dataclass(frozen=True)
class Account:
    """The unprivileged account the server runs as when agentd itself runs as root."""

    name: str
    uid: int
    gid: int


def create_account(name: str) -> pwd.struct_passwd:
    """Create a locked system account without a shell or home for the server (root only)."""
    useradd = shutil.which("useradd")
    if useradd is None:
        raise EmbeddedPgError(
            "PostgreSQL refuses to run as root, no 'postgres' account exists and useradd is "
            "not available to create one; set AGENTD_PG_USER to an unprivileged account of its "
            "own or pass --dsn"
        )
    shell = next((s for s in ("/usr/sbin/nologin", "/sbin/nologin") if os.path.exists(s)),
                 "/bin/false")
    result = subprocess.run(
        [useradd, "--system", "--user-group", "--shell", shell, "--home-dir", "/nonexistent",
         "--no-create-home", "--comment", "agentd embedded PostgreSQL", name],
        capture_output=True, text=True, timeout=60, check=False)
    if result.returncode not in (0, 9):  # 9: it exists (created meanwhile by another start)
        raise EmbeddedPgError(f"could not create the server account {name!r} with useradd "
                              f"(exit {result.returncode}): {result.stderr.strip()}; set "
                              "AGENTD_PG_USER or pass --dsn")
    entry = pwd.getpwnam(name)
    log.warning("created a locked system account for the embedded PostgreSQL server",
                extra={"account": name, "uid": entry.pw_uid})
    return entry


def first_unreachable(path: Path, account: Account) -> Path | None:
    """Return the first folder on ``path`` the account cannot search (mode bits only)."""
    for folder in [*reversed(path.parents), path]:
        try:
            info = folder.stat()
        except OSError:
            return folder
        if info.st_uid == account.uid:
            bit = stat.S_IXUSR
        elif info.st_gid == account.gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not info.st_mode & bit:
            return folder
    return None
