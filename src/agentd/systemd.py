"""systemd integration: readiness notification and the user unit `install-service` writes."""

from __future__ import annotations

import os
import shlex
import socket
import sys
from pathlib import Path


def sd_notify(state: str) -> bool:
    """Send `state` (e.g. READY=1) to systemd when it supervises us; a no-op otherwise."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(state.encode())
        except OSError:
            return False
    return True


def supervised() -> bool:
    """Whether systemd runs us as a service that reports readiness (`Type=notify`)."""
    return bool(os.environ.get("NOTIFY_SOCKET"))


def stopping(within_s: float) -> bool:
    """Tell systemd the stop has begun and may take `within_s` seconds: the unit's own
    TimeoutStopSec= is then a floor, and a longer drain_s is not cut short by SIGKILL."""
    return sd_notify(f"STOPPING=1\nEXTEND_TIMEOUT_USEC={round(within_s * 1_000_000)}")


def unit_text(args: list[str], *, env_file: Path, writable: list[Path],
              optional_writable: list[Path]) -> str:
    """The user unit: `agentd serve` with `args`, secrets from `env_file`, a read-only system.

    `args` must hold no secret (see split_secrets): ExecStart is readable by every local user
    through `systemctl show`, the environment file only by its owner.
    """
    # systemd expands %specifiers and $VARIABLES in ExecStart: both are doubled to stay literal.
    command = " ".join(shlex.quote(a).replace("%", "%%").replace("$", "$$")
                       for a in [sys.executable, "-m", "agentd", *args])
    paths = " ".join([*(_unit_path(p) for p in writable),
                      *(_unit_path(p, prefix="-") for p in optional_writable)])
    return f"""[Unit]
Description=agentd: durable AI-agent turns on PostgreSQL
After=network-online.target

[Service]
Type=notify
NotifyAccess=main
# Secrets (DSN, provider API keys) and AGENTD_* settings: mode 0600, never on the command line.
EnvironmentFile={str(env_file).replace("%", "%%")}
ExecStart={command}
Restart=on-failure
RestartSec=2
# SIGTERM starts the two-phase drain; agentd extends this to its drain budget as it begins
# (EXTEND_TIMEOUT_USEC). Only agentd gets the SIGTERM: it stops its workers and its embedded
# PostgreSQL itself, after the drain, which needs that server up (SIGKILL is for what is left).
TimeoutStopSec=60
KillSignal=SIGTERM
KillMode=mixed
# Hardening: no privilege gain, a private /tmp, and a read-only system except our own data.
NoNewPrivileges=yes
PrivateTmp=yes
ProtectSystem=strict
ReadWritePaths={paths}
LimitNOFILE=65536

[Install]
WantedBy=default.target
"""


SECRET_FLAGS = {"--dsn": "AGENTD_DSN"}


def absolute_paths(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """`args` with the values of path `flags` (as `--flag value` or `--flag=value`) made
    absolute: the unit runs from another directory than the shell that installed it."""
    out: list[str] = []
    items = iter(args)
    for arg in items:
        flag, eq, value = arg.partition("=")
        if flag not in flags:
            out.append(arg)
            continue
        if not eq:
            value = next(items, "")
        absolute = str(Path(value).expanduser().resolve()) if value else value
        out.extend([f"{flag}={absolute}"] if eq else [flag, absolute])
    return out


def split_secrets(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """Move secret-bearing `serve` flags (a DSN holds a password) into environment variables."""
    kept: list[str] = []
    moved: dict[str, str] = {}
    items = iter(args)
    for arg in items:
        flag, eq, value = arg.partition("=")
        if flag in SECRET_FLAGS:
            if not eq:
                value = next(items, "")
            moved[SECRET_FLAGS[flag]] = value
        else:
            kept.append(arg)
    return kept, moved


def environment_file_text(variables: dict[str, str]) -> str:
    """KEY="value" lines as systemd's EnvironmentFile reads them (no expansion of $ or %)."""
    lines = ["# Written by `agentd install-service`: secrets and settings for agentd.service."]
    for key in sorted(variables):
        value = variables[key].replace("\\", "\\\\").replace('"', '\\"')
        if "\n" in value:
            raise ValueError(f"{key} holds a newline, which an environment file cannot carry")
        lines.append(f'{key}="{value}"')
    return "\n".join(lines) + "\n"


def _unit_path(path: Path, *, prefix: str = "") -> str:
    """One word of a path list (ReadWritePaths=): % doubled, quoted if it holds spaces."""
    text = prefix + str(path).replace("%", "%%")
    if any(c.isspace() for c in text) or '"' in text or "\\" in text:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def user_unit_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user" / "agentd.service"


def environment_file_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "agentd" / "agentd.env"
