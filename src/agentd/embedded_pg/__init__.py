"""Run agentd's own PostgreSQL cluster (initdb/pg_ctl) when no DSN is configured.

Invariant: a data directory gets at most one server, started under an exclusive lock, and
stopped only by the last process using it; a stale
``postmaster.pid`` is removed, never reused, and the server never runs as root (nor as a shared
account such as ``nobody``). It authenticates with scram-sha-256 and a generated password kept
in a 0600 file beside the data; a cluster made by an older agentd with ``trust`` is switched over
on its next start.

`binaries` finds PostgreSQL, `account` picks (or creates) the account the server runs as,
`pidfile` tells a live server from a stale pid file, `server` runs it.
"""

from agentd.embedded_pg.binaries import PgBinaries, find_binaries
from agentd.embedded_pg.errors import EmbeddedPgError
from agentd.embedded_pg.server import SUPERUSER, EmbeddedPostgres, default_data_root

__all__ = [
    "SUPERUSER",
    "EmbeddedPgError",
    "EmbeddedPostgres",
    "PgBinaries",
    "default_data_root",
    "find_binaries",
]
