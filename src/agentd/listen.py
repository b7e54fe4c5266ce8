"""The HTTP listen address, taken before anything else starts, and who holds it when it is busy.

`agentd serve` binds its sockets first (bound, not yet listening) and hands them to aiohttp once
the daemon is ready: a busy address fails before the embedded PostgreSQL starts, a migration
runs or a file is written. Two processes starting at once can both bind the port (SO_REUSEADDR
lets sockets share one as long as none listens), so the one that comes second to `claim` is told
there, in the same words, rather than failing in aiohttp with a bare errno.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket

import psutil

COMMAND_CHARS = 160


class ListenError(Exception):
    """The listen address cannot be used; the message says which and why (for the user)."""


def bind_listen_sockets(host: str, port: int) -> list[socket.socket]:
    """One bound (not listening) TCP socket per address `host` resolves to."""
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {listen}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    seen: set[tuple[object, ...]] = set()
    try:
        for family, kind, proto, _name, address in infos:
            if address in seen:
                continue
            seen.add(address)
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            # As asyncio's create_server does: restart over TIME_WAIT; IPv6 sockets IPv6 only.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise _refused(exc, host, port) from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def claim(sockets: list[socket.socket], host: str, port: int, backlog: int = 128) -> None:
    """Start listening on the bound sockets: only now is the port this process's alone."""
    for sock in sockets:
        try:
            sock.listen(backlog)
        except OSError as exc:
            raise _refused(exc, host, port) from None


def _refused(exc: OSError, host: str, port: int) -> ListenError:
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return ListenError(
            f"cannot listen on {listen}: the address is already in use by "
            f"{holder_of(host, port)}. Stop it, or choose another address with "
            f"--listen (or AGENTD_LISTEN).")
    return ListenError(f"cannot listen on {listen}: {exc.strerror}")


def holder_of(host: str, port: int) -> str:
    """Who listens on `host:port`: "pid N (command)" when this user may see it, else a phrase."""
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status != psutil.CONN_LISTEN or not conn.laddr or \
                    conn.laddr.port != port or not _overlaps(conn.laddr.ip, host):
                continue
            if conn.pid is None:
                return "another process (one this user may not inspect)"
            return describe_process(conn.pid)
    return "another process"


def describe_process(pid: int) -> str:
    """"pid N (program and subcommand)": the words of its command line up to its first option
    or value. Its options can hold secrets (`--dsn postgresql://user:password@…`) and this
    message goes to a terminal and the journal, and as root it can describe any user's process."""
    try:
        process = psutil.Process(pid)
        words = process.cmdline()
    except psutil.Error:
        return f"pid {pid}"
    shown: list[str] = []
    for word in words:
        # Past the program: its subcommands, and a Python module named by -m; the first
        # other option, or anything like a value, ends it.
        module = len(shown) >= 2 and shown[-1] == "-m"
        if shown and not module and word != "-m" and (
                word.startswith("-") or any(mark in word for mark in ":=@/?&")):
            break
        shown.append(word)
    command = " ".join(shown) or _name(process)
    if len(command) > COMMAND_CHARS:
        command = command[: COMMAND_CHARS - 1] + "…"
    return f"pid {pid} ({command}{' …' if len(shown) < len(words) else ''})"


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "?"


def _overlaps(bound: str, host: str) -> bool:
    """Could a socket bound to `bound` be what keeps `host` busy (same or a wildcard)?"""
    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host or None, None,
                                                            flags=socket.AI_PASSIVE)}
    except socket.gaierror:
        return True
    for address in (bound, *wanted):
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(str(address).split("%")[0]).is_unspecified:
                return True
    return bound in wanted
