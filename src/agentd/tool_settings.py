"""The tool tables of the config file: `[mcp.<name>]` servers and `[tools]` approval policies.

Secrets never live in the config: an HTTP server's `headers` name environment variables whose
values are sent, and a stdio server gets only the variables its `env` table lists (plus the
SDK's safe few: HOME, LOGNAME, PATH, SHELL, TERM, USER).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from agentd.vocabulary import ApprovalPolicy

NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}$")
_SERVER_KEYS = {"command", "args", "env", "cwd", "url", "headers", "prefix", "approval", "tools",
                "timeout_s", "start_timeout_s"}


class ToolSettingsError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class McpServerConfig:
    """One `[mcp.<name>]` table: how to reach an MCP server and how far to trust its tools."""

    name: str
    command: str | None = None  # stdio: the program to run
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None  # streamable HTTP
    headers: Mapping[str, str] = field(default_factory=dict)  # header -> environment variable
    prefix: str | None = None  # tools appear as `<prefix>.<tool>`; default: the server's name
    approval: ApprovalPolicy = ApprovalPolicy.ASK  # for every tool of the server...
    tools: Mapping[str, ApprovalPolicy] = field(default_factory=dict)  # ...unless named here
    timeout_s: float = 120.0  # one tools/call, not counting an approval wait
    start_timeout_s: float = 30.0  # start, handshake and tool listing

    @property
    def tool_prefix(self) -> str:
        return self.prefix or self.name

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "streamable-http"

    def policy(self, tool: str) -> ApprovalPolicy:
        return self.tools.get(tool, self.approval)


def _policy(value: Any, where: str) -> ApprovalPolicy:
    try:
        return ApprovalPolicy(value)
    except ValueError:
        raise ToolSettingsError(f"{where} must be auto, ask or deny, got {value!r}") from None


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ToolSettingsError(f"{where} must be a list of strings")
    return tuple(value)


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ToolSettingsError(f"{where} must be a table")
    return value


def _positive(value: Any, where: str) -> float:
    # nan passes `<= 0` and inf is no bound: both are refused, as settings.py refuses them.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise ToolSettingsError(f"{where} must be a finite number > 0")
    return float(value)


def parse_server(name: str, spec: Any) -> McpServerConfig:
    where = f"mcp.{name}"
    if not NAME.match(name):
        raise ToolSettingsError(f"{where}: a server name is 1-32 letters, digits, _ or -")
    spec = _table(spec, where)
    unknown = set(spec) - _SERVER_KEYS
    if unknown:
        raise ToolSettingsError(f"{where}: unknown keys {sorted(unknown)}")
    command, url = spec.get("command"), spec.get("url")
    if (command is None) == (url is None):
        raise ToolSettingsError(f"{where}: give either command (stdio) or url (streamable HTTP)")
    if command is not None and (not isinstance(command, str) or not command.strip()):
        raise ToolSettingsError(f"{where}.command must be a non-empty string")
    if url is not None:
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ToolSettingsError(f"{where}.url must be an http:// or https:// URL")
        if parts.username or parts.password:
            raise ToolSettingsError(f"{where}.url must not carry credentials: name them in "
                                    "headers (as environment variables)")
    env = _table(spec.get("env", {}), f"{where}.env")
    for key, value in env.items():
        if not ENV_NAME.match(key) or not isinstance(value, str):
            raise ToolSettingsError(f"{where}.env: {key!r} must be a variable name with a "
                                    "string value")
    headers = _table(spec.get("headers", {}), f"{where}.headers")
    for key, value in headers.items():
        if not HEADER_NAME.match(key):
            raise ToolSettingsError(f"{where}.headers: {key!r} is not a header name")
        if not isinstance(value, str) or not ENV_NAME.match(value):
            raise ToolSettingsError(
                f"{where}.headers.{key} must name an environment variable that holds the "
                "value (secrets never go in the config file)")
    if headers and command is not None:
        raise ToolSettingsError(f"{where}.headers apply to url servers only")
    prefix = spec.get("prefix")
    if prefix is not None and (not isinstance(prefix, str) or not NAME.match(prefix)):
        raise ToolSettingsError(f"{where}.prefix must be 1-32 letters, digits, _ or -")
    tools = {tool: _policy(policy, f"{where}.tools.{tool}")
             for tool, policy in _table(spec.get("tools", {}), f"{where}.tools").items()}
    cwd = spec.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise ToolSettingsError(f"{where}.cwd must be a string")
    return McpServerConfig(
        name=name, command=command, args=_strings(spec.get("args", []), f"{where}.args"),
        env=dict(env), cwd=cwd, url=url, headers=dict(headers), prefix=prefix,
        approval=_policy(spec.get("approval", "ask"), f"{where}.approval"), tools=tools,
        timeout_s=_positive(spec.get("timeout_s", 120.0), f"{where}.timeout_s"),
        start_timeout_s=_positive(spec.get("start_timeout_s", 30.0),
                                  f"{where}.start_timeout_s"))


def parse_mcp(table: Any) -> dict[str, McpServerConfig]:
    servers = {name: parse_server(name, spec)
               for name, spec in _table(table, "mcp").items()}
    prefixes: dict[str, str] = {}
    for server in servers.values():
        other = prefixes.setdefault(server.tool_prefix, server.name)
        if other != server.name:
            raise ToolSettingsError(f"mcp.{server.name} and mcp.{other} both expose tools as "
                                    f"{server.tool_prefix}.*: set a distinct prefix")
    return servers


# The built-in tools, which `[tools]` gives policies to (tools.registry.default_tools makes
# them; a test keeps the two the same).
BUILTIN_TOOLS = frozenset({"calculator", "clock", "notes"})


def parse_tool_policies(table: Any) -> dict[str, ApprovalPolicy]:
    """`[tools]`: the approval policy of built-in tools by name (`auto` when not named). A name
    that is no built-in tool is refused: a typo would leave the tool it meant at `auto`."""
    policies = {name: _policy(value, f"tools.{name}")
                for name, value in _table(table, "tools").items()}
    for name in policies:
        if name not in BUILTIN_TOOLS:
            raise ToolSettingsError(
                f"tools.{name}: no built-in tool has this name (they are "
                f"{', '.join(sorted(BUILTIN_TOOLS))}; an MCP server's tools take their policy "
                "from its own table: [mcp.<name>] approval and tools)")
    return policies
