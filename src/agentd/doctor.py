"""`agentd doctor`: checks an installation end to end and says what to fix."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

from agentd.settings import Settings


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str
    warn: bool = False  # worth knowing, not a fault (e.g. a provider with no key: not offered)


async def run_checks(settings: Settings) -> list[Check]:
    from agentd.providers.catalog import provider_checks
    from agentd.startup import open_database

    checks = [Check("python", sys.version_info >= (3, 11), sys.version.split()[0])]
    # Model providers: offered only when usable; the reasons name what to fix.
    checks += [Check(f"provider {c.provider}", c.ok, c.detail, warn=c.ok and not c.usable)
               for c in provider_checks(settings)]
    if not settings.dsn:
        from agentd.embedded_pg import EmbeddedPgError, find_binaries

        try:
            binaries = find_binaries()
            checks.append(Check("postgresql binaries", True,
                                f"PostgreSQL {binaries.major} in {binaries.bindir}"))
        except EmbeddedPgError as exc:
            checks.append(Check("postgresql binaries", False, f"{exc} (or pass --dsn)"))
            return checks
    try:
        database = await open_database(settings)
    except Exception as exc:
        checks.append(Check("database", False, f"{exc} (check --dsn / AGENTD_DSN)"))
        return checks
    try:
        checks += await _database_checks(settings, database.dsn)
    finally:
        await asyncio.to_thread(database.close)
    checks.append(await _port_check(settings))
    checks.append(await asyncio.to_thread(_tls_check, settings))
    checks.extend(await mcp_checks(settings))
    return checks


async def _database_checks(settings: Settings, dsn: str) -> list[Check]:
    """The database, its migrations, the pool and LISTEN/NOTIFY. A database that cannot be
    reached (with --dsn nothing connects before this) is the finding: reported like every
    other, and the checks that do not need it still run."""
    from agentd import db as dbmod
    from agentd.hub import Hub
    from agentd.migrate import pending
    from agentd.queue import notify_conversation
    from agentd.vocabulary import Channel

    checks: list[Check] = []
    try:
        # Migrations hold a session lock: they go where the daemon sends them (hub_dsn when
        # the pool's DSN is a transaction pooler).
        conn = await dbmod.connect(settings.direct_dsn(dsn))
    except Exception as exc:  # the doctor reports, never raises
        return [Check("database", False, f"cannot connect: {' '.join(str(exc).split())} (check "
                      "--dsn / AGENTD_DSN, and that the server runs and accepts you)")]
    try:
        version = await dbmod.server_version(conn)
        checks.append(Check("database", True, f"PostgreSQL {version}"))
        todo = await pending(conn)
        checks.append(Check("migrations", True, "up to date" if not todo else
                            f"pending: {', '.join(todo)} (applied at serve start)"))
    finally:
        await conn.close()
    checks.append(await _pool_check(settings, dsn))
    hub = Hub(settings.hub_dsn or dsn)
    await hub.start(wait_s=3)
    try:
        async with hub.subscribe(Channel.CONVERSATION, "doctor") as sub:
            probe = await dbmod.connect(dsn)
            try:
                await notify_conversation(probe, "doctor")
            finally:
                await probe.close()
            heard = await sub.wait(3.0)
        checks.append(Check("listen/notify", bool(heard), "round trip ok" if heard else
                            "no NOTIFY received: is the hub DSN behind a transaction "
                            "pooler? point AGENTD_HUB_DSN at PostgreSQL directly"))
    finally:
        await hub.close()
    return checks


async def _pool_check(settings: Settings, dsn: str) -> Check:
    """A statement through the pool's DSN, set up as the daemon sets up its pool."""
    from agentd import db as dbmod

    try:
        pool = await dbmod.create_pool(dsn, min_size=1, max_size=1, pooled=settings.pooled)
        try:
            async with pool.acquire() as conn:
                await dbmod.ping(conn)
        finally:
            await pool.close()
    except Exception as exc:  # any failure is the finding; the doctor reports, never raises
        hint = "" if settings.pooled else (": if dsn goes through PgBouncer in transaction "
                                           "mode, set pooler = transaction")
        return Check("pool", False, f"{exc}{hint}")
    if settings.pooled:
        return Check("pool", True, "through a transaction pooler (pooler = transaction): no "
                     "prepared statements or session settings on it; LISTEN, migrations and "
                     "the heartbeat use hub_dsn")
    return Check("pool", True, "direct (pooler = none)")


async def mcp_checks(settings: Settings) -> list[Check]:
    """Start each configured MCP server as the daemon would, and report its state and tools."""
    if not settings.mcp:
        return []
    from agentd.tools.mcp import McpTools

    servers = McpTools(settings.mcp)
    try:
        await servers.tools()
        checks = []
        for status in servers.status():
            if status.state == "ready":
                detail = f"ready ({status.transport}): {len(status.tools)} tools"
                if status.tools:
                    detail += ": " + ", ".join(status.tools)
            else:
                detail = f"{status.state} ({status.transport}): {status.error}"
            disabled = sorted(status.disabled.items())
            for tool, reason in disabled[:20]:
                detail += f"; tool {tool!r} disabled: {reason}"
            if len(disabled) > 20:
                detail += f"; {len(disabled) - 20} more tools disabled"
            checks.append(Check(f"mcp {status.name}",
                                status.state == "ready" and not status.disabled, detail))
        return checks
    finally:
        await servers.close()


async def _port_check(settings: Settings) -> Check:
    from agentd.listen import ListenError, bind_listen_sockets

    try:
        sockets = bind_listen_sockets(settings.listen_host, settings.listen_port)
    except ListenError as exc:
        # Busy because this agentd is running: what a healthy install looks like.
        if await _agentd_answers(settings):
            return Check("listen address", True,
                         f"{settings.listen} is served by a running agentd")
        return Check("listen address", False, str(exc))
    for sock in sockets:
        sock.close()
    return Check("listen address", True, f"{settings.listen} is free")


async def _agentd_answers(settings: Settings) -> bool:
    """Is what holds the listen address an agentd? Its /healthz answers {"status": "ok"} (with
    its worker to a caller it sees on loopback, which a daemon on a specific other address of
    this machine does not). Only asked, never trusted with a token: the certificate is not
    checked."""
    import aiohttp

    from agentd.tls import local_url

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session, \
                session.get(f"{local_url(settings)}/healthz", ssl=False) as response:
            body = await response.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False
    return response.status == 200 and isinstance(body, dict) and body.get("status") == "ok" \
        and set(body) <= {"status", "worker_id"}


def _tls_check(settings: Settings) -> Check:
    from agentd.tls import TLSError, expiry_problem, server_certificate

    if not settings.serves_tls:
        if settings.listen_is_loopback:
            return Check("tls", True, "plain HTTP on loopback (any other address serves HTTPS)")
        return Check("tls", True, f"warning: PLAIN HTTP on {settings.listen} (insecure_http): "
                     "tokens cross the network in clear text")
    try:
        cert = server_certificate(settings)
    except TLSError as exc:
        return Check("tls", False, str(exc))
    except OSError as exc:  # the data directory's tls/ cannot be made or written
        return Check("tls", False, f"cannot use {exc.filename or 'the TLS directory'}: "
                                   f"{exc.strerror or exc}")
    kind = "self-signed" if cert.self_signed else "configured"
    ending = expiry_problem(cert)
    if ending is not None and not cert.self_signed:  # a self-signed one is made anew in time
        expired = ending.startswith("expired")
        return Check("tls", not expired, f"configured certificate {cert.cert_path} {ending}: "
                     "renew it (clients refuse an expired one)", warn=not expired)
    return Check("tls", True, f"{kind} certificate {cert.fingerprint}, valid until "
                 f"{cert.not_after:%Y-%m-%d} ({cert.cert_path})")
