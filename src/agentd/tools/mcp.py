"""MCP servers as a tool source, through the official `mcp` SDK: one connection per configured
server per agentd process, started on first use, shared by every run, restarted with backoff.

Each server is supervised by one task that owns its `mcp.Client` (the SDK's task groups must be
entered and left by one task); runs call tools on the shared client from their own tasks. A
call carries the run id, conversation id and fence in `_meta`; cancelling the calling task
makes the SDK send `notifications/cancelled` for it. Output that is not JSON-RPC, or the server
going away, tears the connection down: calls in flight fail at once instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import anyio
import mcp_types
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from agentd import __version__
from agentd.tool_settings import McpServerConfig
from agentd.tools.registry import InvalidToolSchema, Tool, ToolContext, ToolError

log = logging.getLogger("agentd.mcp")

META_RUN_ID = "agentd/run_id"
META_CONVERSATION_ID = "agentd/conversation_id"
META_FENCE = "agentd/fence"
BACKOFF_FIRST_S = 0.5
# How long a turn's tool listing waits for a server whose last starts failed.
FAILING_SERVER_WAIT_S = 1.0
BACKOFF_MAX_S = 60.0
STABLE_AFTER_S = 60.0  # a connection that lived this long resets the backoff
MAX_TOOL_PAGES = 100
# Every turn offers the model every tool (their specs go with each model request): a server
# listing thousands, or megabytes of schema, made every turn too large for its provider, and
# each listing is compiled on the event loop. The bound is per server; a provider's own limit
# is on the sum (OpenAI takes 128 tools in all): docs/tools.md says to deny what is not needed.
MAX_TOOLS_PER_SERVER = 128
MAX_DESCRIPTION_CHARS = 2_000  # longer ones are cut, not refused
MAX_SCHEMA_CHARS = 50_000  # as JSON; a larger input schema disables its tool
MAX_RESULT_CHARS = 100_000
VALID_TOOL_NAME = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


# By the server's state when a caller gives up on it ("starting" also after a failure: a new
# attempt is under way).
_WHY_UNAVAILABLE = {"failed": "it failed to start", "starting": "it is still starting",
                    "restarting": "it is being restarted"}

class McpUnavailable(ToolError):
    """The server is not connected (and could not be within its start timeout)."""


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """What `agentd doctor` and the logs show for one server."""

    name: str
    transport: str
    state: str  # not started | starting | ready | restarting | failed | stopped
    error: str | None
    tools: list[str]
    disabled: dict[str, str]  # tool -> why it is not offered
    restarts: int


class _Broken(Exception):
    """The connection is unusable; the message says why, in words for people."""


class _WatchedReads:
    """The transport's read stream, reporting its end and any item that is not JSON-RPC."""

    def __init__(self, inner: Any, on_broken: Any) -> None:
        self._inner = inner
        self._on_broken = on_broken

    async def receive(self) -> Any:
        try:
            item = await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._on_broken("the server closed the connection (it exited or hung up)")
            raise
        if isinstance(item, Exception):
            self._on_broken(_garbage_reason(item))
        return item

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> _WatchedReads:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def __aenter__(self) -> _WatchedReads:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def last_context(self) -> Any:
        return getattr(self._inner, "last_context", None)


def _garbage_reason(exc: Exception) -> str:
    if isinstance(exc, ValueError):
        return "the server wrote output that is not JSON-RPC"
    return f"the transport failed ({type(exc).__name__})"


class McpServer:
    """One `[mcp.<name>]` server: its connection, tool list, state and last error."""

    def __init__(self, config: McpServerConfig, *,
                 environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self._environ = os.environ if environ is None else environ
        self.state = "not started"
        self.error: str | None = None
        self.restarts = 0
        self.tools: dict[str, Tool] = {}  # by the name models see (`<prefix>.<tool>`)
        self.disabled: dict[str, str] = {}
        self._client: Client | None = None
        self._broken_reason: str | None = None
        self._wake = asyncio.Event()  # relist, broken or closing
        self._relist = False
        self._closing = False
        self._demand = asyncio.Event()
        self._changed = asyncio.Event()  # pulsed on every state change
        self._next_attempt = 0.0
        self._failures = 0  # attempts that never got ready, since the last success
        self._unknown_policies: list[str] = []  # policies naming tools it does not list, said
        self._task: asyncio.Task[None] | None = None
        self._starting: anyio.CancelScope | None = None  # cancelled if it breaks while starting
        self._was_ready = False  # the current connection got as far as serving

    # --- what runs use ------------------------------------------------------------------

    @property
    def failing(self) -> bool:
        """Whether its last start attempts all failed (none got ready since)."""
        return self._failures > 0

    async def ensure_ready(self, *, wait_for_restart: bool = True,
                           within_s: float | None = None) -> None:
        """Start the server if needed and wait until it is ready, at most start_timeout_s (or
        `within_s`; the start goes on after); raises McpUnavailable (naming the reason) when
        it is not. Without wait_for_restart, a server between a crash and its restart is
        unavailable at once (listing tools for a turn must not wait out a backoff)."""
        if self.state == "ready":
            return
        if self.state == "restarting" and not wait_for_restart:
            raise McpUnavailable(self._unavailable())
        if self._closing:
            raise McpUnavailable(f"MCP server {self.config.name!r} is stopped")
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name=f"mcp-{self.config.name}")
        loop = asyncio.get_running_loop()
        if self.state == "failed" and loop.time() < self._next_attempt:
            raise McpUnavailable(self._unavailable(retry_in=self._next_attempt - loop.time()))
        failures = self._failures
        self._demand.set()
        deadline = loop.time() + (self.config.start_timeout_s + 1.0 if within_s is None
                                  else within_s)
        while self.state != "ready":
            if self._failures > failures or self._closing:
                raise McpUnavailable(self._unavailable())
            changed = self._changed
            left = deadline - loop.time()
            if left <= 0:
                raise McpUnavailable(self._unavailable())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    async def call(self, tool: str, args: dict[str, Any], ctx: ToolContext) -> Any:
        """Call a tool by its server-side name; a failure of any kind is a ToolError."""
        await self.ensure_ready()
        client = self._client
        if client is None:
            raise McpUnavailable(self._unavailable())
        # An open map (extra keys round-trip): ours are named by constants, not literals.
        meta = cast(mcp_types.RequestParamsMeta, {
            META_RUN_ID: str(ctx.run_id), META_CONVERSATION_ID: str(ctx.conversation_id),
            META_FENCE: ctx.fence})
        name = self.config.name
        try:
            result = await client.call_tool(tool, args, read_timeout_seconds=self.config.timeout_s,
                                            meta=meta)
        except MCPError as exc:
            if exc.error.code == mcp_types.CONNECTION_CLOSED:
                reason = self._broken_reason or "the server closed the connection"
                self._mark_broken(reason)
                raise ToolError(f"MCP server {name!r} failed during the call: {reason}; "
                                "it is being restarted") from None
            if exc.error.code == mcp_types.REQUEST_TIMEOUT:
                raise ToolError(f"MCP server {name!r} did not answer within "
                                f"{self.config.timeout_s:g} s") from None
            raise ToolError(f"MCP server {name!r} refused the call: "
                            f"{exc.error.message[:500]}") from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            reason = self._broken_reason or "the connection is closed"
            raise ToolError(f"MCP server {name!r} failed during the call: {reason}") from None
        except ValueError as exc:  # a result that is not a valid CallToolResult
            raise ToolError(f"MCP server {name!r} answered with an invalid result "
                            f"({type(exc).__name__})") from None
        except Exception as exc:
            # Anything else the SDK raises: a result that breaks the tool's own output schema
            # (RuntimeError), and whatever a later SDK adds. The call may have run: the model is
            # told it failed to come back, not that it never ran; the detail is for the log.
            log.warning("mcp call failed", extra={"server": name, "tool": tool,
                                                  "error": f"{type(exc).__name__}: {exc}"})
            raise ToolError(f"MCP server {name!r} answered, but its result could not be used "
                            f"({type(exc).__name__}); the call may have run") from None
        return _result_value(name, result)

    def status(self) -> ServerStatus:
        return ServerStatus(self.config.name, self.config.transport, self.state, self.error,
                            sorted(self.tools), dict(self.disabled), self.restarts)

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        self._demand.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._set_state("stopped")

    # --- the supervisor -----------------------------------------------------------------

    def _unavailable(self, retry_in: float | None = None) -> str:
        # What the model and every attached device read: the reason stays in the log and
        # `agentd doctor`, since it can name an environment variable, a path or quote the
        # server.
        why = _WHY_UNAVAILABLE.get(self.state, "it is not ready")
        retry = f"; next attempt in {retry_in:.0f} s" if retry_in is not None else ""
        return f"MCP server {self.config.name!r} is unavailable: {why}{retry}"

    def _set_state(self, state: str, error: str | None = None) -> None:
        self.state = state
        if error is not None or state == "ready":
            self.error = error
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _mark_broken(self, reason: str) -> None:
        if self._broken_reason is None:
            self._broken_reason = reason
        self._wake.set()
        if self.state == "ready" and not self._closing:
            # From now on callers wait for the restart instead of using the dead connection.
            self._client = None
            self._set_state("restarting", reason)
        if self._starting is not None:
            self._starting.cancel()  # a handshake request would otherwise wait for its timeout

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        delay = BACKOFF_FIRST_S
        while not self._closing:
            await self._demand.wait()
            wait = self._next_attempt - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if self._closing:
                return
            self._set_state("starting")
            started = time.monotonic()
            self._was_ready = False
            try:
                await self._connect_and_serve()
                reason = "stopped"
            except _Broken as exc:
                reason = str(exc)
            except Exception as exc:  # anything the SDK or the transport raised
                reason = _describe(exc)
                log.warning("mcp connection error", exc_info=exc,
                          extra={"server": self.config.name})
            self._client = None
            self.tools = {}
            if self._closing:
                return
            if self._was_ready:
                # It died after serving: restart on its own, after a pause.
                if time.monotonic() - started >= STABLE_AFTER_S:
                    delay = BACKOFF_FIRST_S
                self.restarts += 1
                self._next_attempt = loop.time() + delay
                log.warning("mcp server connection ended; restarting",
                            extra={"server": self.config.name, "error": reason,
                                   "retry_in_s": delay})
                self._set_state("restarting", reason)
                self._demand.set()
            else:
                # It never got ready: try again only when a run needs it, and not too soon.
                self._failures += 1
                self._next_attempt = loop.time() + delay
                log.warning("mcp server failed to start",
                            extra={"server": self.config.name, "error": reason})
                self._set_state("failed", reason)
                self._demand.clear()
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _connect_and_serve(self) -> None:
        """Connect, list tools, then serve until broken or closed."""
        self._broken_reason = None
        self._wake.clear()
        self._relist = False
        ready = False
        with anyio.CancelScope() as scope:
            self._starting = scope
            timer = asyncio.get_running_loop().call_later(self.config.start_timeout_s,
                                                          scope.cancel)
            try:
                async with Client(
                        self._transport(), mode="auto",
                        read_timeout_seconds=self.config.start_timeout_s,
                        message_handler=self._on_message, cache=None,
                        client_info=mcp_types.Implementation(name="agentd",
                                                             version=__version__)) as client:
                    await self._list_tools(client)
                    timer.cancel()
                    self._starting = None
                    self._client = client
                    ready = self._was_ready = True
                    self._failures = 0
                    log.info("mcp server ready", extra={
                        "server": self.config.name, "tools": len(self.tools),
                        "protocol": client.protocol_version})
                    self._set_state("ready")
                    await self._serve(client)
            finally:
                timer.cancel()
                self._starting = None
                self._client = None
        if scope.cancelled_caught and not ready:
            raise _Broken(self._broken_reason or "it did not finish starting within "
                          f"{self.config.start_timeout_s:g} s")
        if self._broken_reason is not None and not self._closing:
            raise _Broken(self._broken_reason)

    async def _serve(self, client: Client) -> None:
        listening = None
        if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
            listening = asyncio.create_task(self._listen_for_changes(client))
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._closing or self._broken_reason is not None:
                    return
                if self._relist:
                    self._relist = False
                    with anyio.fail_after(self.config.start_timeout_s):
                        await self._list_tools(client)
                    log.info("mcp tool list refreshed",
                             extra={"server": self.config.name, "tools": len(self.tools)})
                    self._set_state("ready")
        finally:
            if listening is not None:
                listening.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await listening

    async def _listen_for_changes(self, client: Client) -> None:
        """2026-era servers announce tool list changes on a subscriptions/listen stream."""
        try:
            async with client.listen(tools_list_changed=True) as changes:
                async for _event in changes:
                    self._relist = True
                    self._wake.set()
        except Exception as exc:  # unsupported or lost: older servers notify through messages
            log.debug("mcp listen stream ended", extra={"server": self.config.name,
                                                        "error": repr(exc)})

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, Exception):
            self._mark_broken(_garbage_reason(message))
        elif isinstance(message, mcp_types.ToolListChangedNotification):
            self._relist = True
            self._wake.set()

    @contextlib.asynccontextmanager
    async def _transport(self) -> AsyncIterator[Any]:
        config = self.config
        async with contextlib.AsyncExitStack() as stack:
            if config.command is not None:
                params = StdioServerParameters(command=config.command, args=list(config.args),
                                               env=dict(config.env) or None, cwd=config.cwd)
                reads, writes = await stack.enter_async_context(stdio_client(params))
            else:
                import httpx2

                headers = {}
                for header, variable in config.headers.items():
                    value = self._environ.get(variable)
                    if value is None:
                        raise _Broken(f"header {header} takes its value from the environment "
                                      f"variable {variable}, which is not set")
                    headers[header] = value
                http = await stack.enter_async_context(httpx2.AsyncClient(
                    headers=headers, timeout=httpx2.Timeout(30.0, read=300.0)))
                assert config.url is not None
                reads, writes = await stack.enter_async_context(
                    streamable_http_client(config.url, http_client=http))
            yield _WatchedReads(reads, self._mark_broken), writes

    async def _list_tools(self, client: Client) -> None:
        listed: list[mcp_types.Tool] = []
        cursor: str | None = None
        for _page in range(MAX_TOOL_PAGES):
            page = await client.list_tools(cursor=cursor, cache_mode="bypass")
            listed.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        tools: dict[str, Tool] = {}
        disabled: dict[str, str] = {}
        for remote in listed:
            reason = self._unusable(remote)
            if reason is None and len(tools) >= MAX_TOOLS_PER_SERVER:
                reason = f"the server lists more than {MAX_TOOLS_PER_SERVER} usable tools"
            if reason is None:
                try:
                    tool = Tool(f"{self.config.tool_prefix}.{remote.name}",
                                _description(remote), remote.input_schema,
                                _caller(self, remote.name), self.config.policy(remote.name),
                                self.config.name)
                    tools[tool.name] = tool
                    continue
                except InvalidToolSchema as exc:
                    reason = str(exc)
            disabled[remote.name[:200]] = reason
            if len(disabled) <= 20:  # a server listing thousands is told in one more line
                log.warning("mcp tool disabled", extra={
                    "server": self.config.name, "tool": remote.name[:100], "reason": reason})
        if len(disabled) > 20:
            log.warning("mcp tools disabled", extra={"server": self.config.name,
                                                     "tools": len(disabled)})
        self.tools, self.disabled = tools, disabled
        unknown = sorted(set(self.config.tools) - {remote.name for remote in listed})
        said, self._unknown_policies = self._unknown_policies, unknown
        if unknown and unknown != said:  # said once while it stays so, not at every refresh
            # A policy for a tool the server does not offer: a typo leaves the tool it meant
            # at the server's policy. Not fatal (a server may offer it later), but said.
            log.warning("mcp tool policies name tools the server does not list", extra={
                "server": self.config.name, "tools": ", ".join(t[:100] for t in unknown[:20])})

    @staticmethod
    def _unusable(remote: mcp_types.Tool) -> str | None:
        name = remote.name
        if not 0 < len(name) <= 128 or not set(name) <= VALID_TOOL_NAME:
            return "its name is not 1-128 letters, digits, '_', '-' or '.'"
        try:
            size = len(json.dumps(remote.input_schema))
        except (TypeError, ValueError, RecursionError):
            return "its input schema cannot be read as JSON"
        if size > MAX_SCHEMA_CHARS:
            return f"its input schema is larger than {MAX_SCHEMA_CHARS:,} characters"
        return None


def _description(remote: mcp_types.Tool) -> str:
    text = remote.description or remote.title or remote.name
    return text if len(text) <= MAX_DESCRIPTION_CHARS else text[:MAX_DESCRIPTION_CHARS - 1] + "…"


def _caller(server: McpServer, remote: str) -> Any:
    async def call(args: dict[str, Any], ctx: ToolContext) -> Any:
        return await server.call(remote, args, ctx)

    return call


def _result_value(server: str, result: mcp_types.CallToolResult) -> Any:
    """What the model reads: the structured result when there is one, else the text parts."""
    texts = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            texts.append(block.text)
        else:
            texts.append(f"[{block.type} content]")
    text = "\n".join(texts)[:MAX_RESULT_CHARS]
    if result.is_error:
        raise ToolError(text or f"the tool on MCP server {server!r} reported an error")
    if result.structured_content is not None:
        # Bounded like the text: it is stored, journaled, streamed to every device and sent to
        # the model at every later step.
        size = len(json.dumps(result.structured_content, ensure_ascii=False, default=str))
        if size > MAX_RESULT_CHARS:
            raise ToolError(f"the tool on MCP server {server!r} ran, but its result is too "
                            f"large to pass on ({size} characters; at most "
                            f"{MAX_RESULT_CHARS})")
        return result.structured_content
    return text


def _describe(exc: BaseException) -> str:
    """A failure to connect, in words for people (no tracebacks)."""
    if isinstance(exc, BaseExceptionGroup):
        inner = exc.exceptions[0] if exc.exceptions else exc
        return _describe(inner)
    if isinstance(exc, FileNotFoundError):
        return "the command was not found"
    if isinstance(exc, PermissionError):
        return "the command is not executable"
    if isinstance(exc, OSError):
        return f"it could not be started or reached ({exc.strerror or type(exc).__name__})"
    if isinstance(exc, MCPError):
        if exc.error.code == mcp_types.CONNECTION_CLOSED:
            return "the server closed the connection during the handshake"
        if exc.error.code == mcp_types.REQUEST_TIMEOUT:
            return "the server did not answer the handshake"
        return f"the handshake failed: {exc.error.message[:300]}"
    if isinstance(exc, TimeoutError):
        return "the server did not answer in time"
    return f"the connection failed ({type(exc).__name__})"


class McpTools:
    """Every configured MCP server; a ToolSource for the registry."""

    def __init__(self, configs: Mapping[str, McpServerConfig], *,
                 environ: Mapping[str, str] | None = None) -> None:
        self.servers = {config.tool_prefix: McpServer(config, environ=environ)
                        for config in configs.values()}

    async def tools(self) -> list[Tool]:
        """Every ready server's tools; servers start here on first use, concurrently. A server
        that cannot start is left out (logged, and shown by doctor). A server whose last starts
        failed is waited for briefly: its next attempt, which may take start_timeout_s, goes on
        behind the turn rather than in front of it (and of every turn starting meanwhile)."""
        results = await asyncio.gather(
            *(s.ensure_ready(wait_for_restart=False,
                             within_s=FAILING_SERVER_WAIT_S if s.failing else None)
              for s in self.servers.values()),
            return_exceptions=True)
        found: list[Tool] = []
        for server, outcome in zip(self.servers.values(), results, strict=True):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if outcome is None:
                found.extend(server.tools.values())
        return found

    async def find(self, name: str) -> Tool | None:
        """A tool by the name models see; raises McpUnavailable when its server cannot start."""
        prefix, dot, _rest = name.partition(".")
        server = self.servers.get(prefix) if dot else None
        if server is None:
            return None
        await server.ensure_ready()
        return server.tools.get(name)

    def status(self) -> list[ServerStatus]:
        return [server.status() for server in self.servers.values()]

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.servers.values()))
