"""A small MCP server for the tool tests, written with the SDK's MCPServer (FastMCP in mcp 1.x).

It records what it sees in a journal file (one JSON object a line) named by TEST_MCP_JOURNAL, so
a test reads, from outside the daemon, the `_meta` each call carried and whether a cancellation
reached it. Run: `python mcp_server.py stdio` or `python mcp_server.py http PORT`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("agentd-test", version="1.0")
JOURNAL = os.environ.get("TEST_MCP_JOURNAL")
_WIRE = os.dup(1)  # the protocol stream, before the SDK moves it (wire_fd)


def note(event: str, **fields: Any) -> None:
    if JOURNAL:
        with open(JOURNAL, "a", encoding="utf-8") as out:
            out.write(json.dumps({"event": event, "pid": os.getpid(), "at": time.time(),
                                  **fields}) + "\n")


def agentd_meta(ctx: Context) -> dict[str, Any]:
    meta = ctx.request_context.meta or {}
    return {key: meta[key] for key in meta if str(key).startswith("agentd/")}


@server.tool()
async def echo_meta(text: str, ctx: Context) -> dict[str, Any]:
    """Echo the text and the agentd `_meta` fields this call carried."""
    meta = agentd_meta(ctx)
    request = ctx.request_context.request
    header = request.headers.get("x-test-token") if request is not None else None
    note("echo_meta", text=text, meta=meta, header=header)
    return {"text": text, "meta": meta}


def wire_fd() -> int:
    """The descriptor the SDK answers on. The SDK moves the protocol off fd 1 once it starts
    (so a stray print cannot corrupt it); a duplicate of fd 1 taken at import, before that, is
    the same stream, whether the parent made it a pipe (asyncio) or a socket (uvloop)."""
    return _WIRE


@server.tool()
async def garble(ctx: Context) -> str:
    """Write a line that is not JSON-RPC on the protocol stream mid-call, then never answer."""
    note("garble", meta=agentd_meta(ctx), fd=wire_fd())
    os.write(wire_fd(), b"this is not JSON-RPC\n")
    await anyio.sleep(3600)
    return "unreachable"


@server.tool()
async def slow(seconds: float, ctx: Context) -> str:
    """Sleep for `seconds`, noting whether a cancellation interrupted it."""
    meta = agentd_meta(ctx)
    note("slow_started", meta=meta)
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        note("slow_cancelled", meta=meta)
        raise
    note("slow_finished", meta=meta)
    return f"slept {seconds} s"


@server.tool()
async def crash(ctx: Context) -> str:
    """Exit the whole server process in the middle of the call."""
    note("crash", meta=agentd_meta(ctx))
    os._exit(3)


@server.tool()
async def broken(value: int) -> int:
    """Its input schema is replaced below by one that is not a valid JSON schema."""
    return value


@server.tool()
async def add_tool(ctx: Context) -> str:
    """Offer one more tool, `added`, and announce that the tool list changed."""

    async def added() -> str:
        """A tool that appeared after the server started."""
        return "added says hello"

    server.add_tool(added, name="added")
    await ctx.notify_tools_changed()
    note("tools_changed")
    return "added"


@server.tool()
async def big(size: int) -> dict[str, Any]:
    """A structured result of about `size` characters."""
    note("big", size=size)
    return {"data": "x" * size}


@server.tool()
async def wrong_shape() -> dict[str, Any]:
    """Runs, then answers a result its own output schema (replaced below) does not allow."""
    note("wrong_shape")
    return {"name": "not a count"}


# The SDK's client checks each result against the tool's declared output schema.
server._tool_manager.get_tool("wrong_shape").output_schema = {  # type: ignore[union-attr]
    "type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}

# An invalid JSON schema (there is no type "objekt"): agentd must disable this tool, not crash.
server._tool_manager.get_tool("broken").parameters = {  # type: ignore[union-attr]
    "type": "object", "properties": {"value": {"type": "integer", "minimum": "zero"}}}


@server.tool()
async def dangling(value: int) -> int:
    """Its schema (replaced below) is valid but points at a definition it lacks."""
    return value


# Valid as a schema, but its `$ref` resolves nowhere: only checking arguments finds out.
# TEST_MCP_DANGLING_REF points it elsewhere (a URL agentd must never fetch).
server._tool_manager.get_tool("dangling").parameters = {  # type: ignore[union-attr]
    "type": "object", "properties": {"value": {
        "$ref": os.environ.get("TEST_MCP_DANGLING_REF", "#/$defs/nope")}}}


# TEST_MCP_MANY_TOOLS=N: N more tools, one of them with a schema past agentd's bound and
# one with a long description (what a server listing everything it can do looks like).
for _n in range(int(os.environ.get("TEST_MCP_MANY_TOOLS") or 0)):
    server.add_tool(lambda value=0: value, name=f"many_{_n:04d}",
                    description="d" * 5_000 if _n == 1 else f"tool number {_n}")
    if _n == 0:
        server._tool_manager.get_tool("many_0000").parameters = {  # type: ignore[union-attr]
            "type": "object", "properties": {
                f"p{i}": {"type": "string", "description": "x" * 100} for i in range(600)}}


def main() -> None:
    note("started", argv=sys.argv[1:])
    if len(sys.argv) > 1 and sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()
