"""A TCP relay in front of the test's PostgreSQL that can lose the answer to a statement that
committed: `async with AnswerCutter(dsn) as cutter:` gives `cutter.dsn`, a DSN through it;
`cutter.cut(marker)` arms it (`cut(marker, then=b"COMMIT")`: the answer to that connection's next
statement holding `then`, such as the COMMIT of the transaction `marker` was sent in).

Armed, the first connection whose client sends bytes holding `marker` (a bound parameter, such
as a worker's name or a message's text) has its statement run by the server as usual, the
server's whole answer withheld, and once the server is ready for the next statement (its
ReadyForQuery: the implicit transaction has committed) both sides closed. The client sees what
a broken link or a restarted server gives it, a connection lost in the middle of an operation,
for a statement that did commit. No library relays PostgreSQL's protocol this way; the part
read here is its framing alone (a type byte and a length), on the server's side.

`cutter.stall(marker)` makes the links open now whose first bytes (the startup message, with its
application_name) held `marker` go silent: from then on nothing they send reaches the server and
nothing it answers comes back, and nothing is closed, as over a link that died without a word.
Links opened later are relayed.

`cutter.refuse_new(sqlstate, message)` answers every link opened from then on as a server that
takes no more does: a FATAL ErrorResponse to its startup message (e.g. 53300, "sorry, too many
clients already"), then the close. `refuse_new(None)` lets them through again.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

_READY_FOR_QUERY = ord("Z")
_BACKEND_KEY_DATA = ord("K")


class AnswerCutter:
    def __init__(self, upstream_dsn: str) -> None:
        self._upstream = urlsplit(upstream_dsn)
        self._server: asyncio.Server | None = None
        self._marker: bytes | None = None
        self._then: bytes | None = None
        self._pumps: set[asyncio.Task[None]] = set()
        self._startups: list[tuple[bytes, asyncio.Event]] = []  # each link's first bytes
        self._refusal: bytes | None = None  # what a new link's startup is answered with
        self.refused = 0
        # The server's process for each link (from its BackendKeyData): the backends that serve
        # the relay's clients, to be found in pg_stat_activity.
        self.backend_pids: set[int] = set()
        self.cut_done = asyncio.Event()  # set once an armed cut has closed its connection
        self.dsn = ""

    async def __aenter__(self) -> AnswerCutter:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        query = [(k, v) for k, v in parse_qsl(self._upstream.query) if k not in ("host", "port")]
        query.append(("sslmode", "disable"))  # the relay reads the server's plain framing
        user = self._upstream.username or "postgres"
        self.dsn = urlunsplit((self._upstream.scheme, f"{user}@127.0.0.1:{port}",
                               self._upstream.path, urlencode(query), ""))
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._server is not None
        self._server.close()
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        await self._server.wait_closed()

    def cut(self, marker: bytes, *, then: bytes | None = None) -> None:
        """Lose the answer to the next statement whose bytes hold `marker` (once), or with
        `then`, to the next statement holding `then` on the connection that sent `marker`."""
        self.cut_done.clear()
        self._marker, self._then = marker, then

    def stall(self, marker: bytes) -> int:
        """Silence the open links whose startup held `marker`; how many there were."""
        silenced = [quiet for startup, quiet in self._startups if marker in startup]
        for quiet in silenced:
            quiet.set()
        return len(silenced)

    def refuse_new(self, sqlstate: str | None, message: str = "") -> None:
        """Answer links opened from now on with a FATAL error (None: relay them again)."""
        if sqlstate is None:
            self._refusal = None
            return
        fields = b"".join(kind + value.encode() + b"\0" for kind, value in (
            (b"S", "FATAL"), (b"V", "FATAL"), (b"C", sqlstate), (b"M", message)))
        body = fields + b"\0"
        self._refusal = b"E" + struct.pack("!I", len(body) + 4) + body

    async def _open_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        query = dict(parse_qsl(self._upstream.query))
        host = query.get("host") or unquote(self._upstream.hostname or "127.0.0.1")
        port = int(query.get("port") or self._upstream.port or 5432)
        if host.startswith("/"):
            return await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
        return await asyncio.open_connection(host, port)

    async def _relay(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pumps.add(task)
        cutting = asyncio.Event()
        quiet = asyncio.Event()
        if self._refusal is not None:
            refusal = self._refusal
            try:
                length = struct.unpack("!I", await client_r.readexactly(4))[0]
                await client_r.readexactly(length - 4)  # the startup message
                client_w.write(refusal)
                await client_w.drain()
                self.refused += 1
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                client_w.close()
                self._pumps.discard(task)
            return
        server_r, server_w = await self._open_upstream()
        try:
            await asyncio.gather(self._from_client(client_r, server_w, cutting, quiet),
                                 self._from_server(server_r, client_w, cutting, quiet))
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the link closed, or the relay is closing: this task is the relay's own
        finally:
            for writer in (client_w, server_w):
                writer.close()
            self._startups = [(first, q) for first, q in self._startups if q is not quiet]
            self._pumps.discard(task)

    async def _from_client(self, reader: asyncio.StreamReader, server: asyncio.StreamWriter,
                           cutting: asyncio.Event, quiet: asyncio.Event) -> None:
        waiting_for: bytes | None = None  # this connection sent the marker: cut at this
        first = True
        while chunk := await reader.read(65536):
            if first:
                self._startups.append((chunk, quiet))
                first = False
            if quiet.is_set():
                continue  # lost on the way, like everything on a dead link
            if self._marker is not None and self._marker in chunk:
                self._marker, waiting_for, self._then = None, self._then, None
                if waiting_for is None:
                    cutting.set()
            elif waiting_for is not None and waiting_for in chunk:
                waiting_for = None
                cutting.set()
            server.write(chunk)
            await server.drain()
        server.close()

    async def _from_server(self, reader: asyncio.StreamReader, client: asyncio.StreamWriter,
                           cutting: asyncio.Event, quiet: asyncio.Event) -> None:
        while True:
            head = await reader.readexactly(5)
            kind, length = head[0], struct.unpack("!I", head[1:])[0]
            body = await reader.readexactly(length - 4)
            if kind == _BACKEND_KEY_DATA:
                self.backend_pids.add(struct.unpack("!I", body[:4])[0])
            if quiet.is_set():
                continue  # a link that died without a word: nothing comes back, nothing closes
            if not cutting.is_set():
                client.write(head + body)
                await client.drain()
            elif kind == _READY_FOR_QUERY:
                # The statement has committed and its answer is withheld: the link breaks.
                with contextlib.suppress(OSError):
                    client.transport.abort()
                self.cut_done.set()
                return


@contextlib.asynccontextmanager
async def relayed(spawn_daemon: Callable[..., Any], dsn: str,
                  **settings: Any) -> AsyncIterator[tuple[AnswerCutter, Any]]:
    """A ready daemon (tests/support/daemon.py) whose every link to the database goes through
    a relay: (the relay, the daemon). The daemon goes before the relay it talks through."""
    async with AnswerCutter(dsn) as relay:
        daemon = spawn_daemon(dsn=relay.dsn, **settings)
        try:
            await daemon.wait_ready()
            yield relay, daemon
        finally:
            daemon.close()
