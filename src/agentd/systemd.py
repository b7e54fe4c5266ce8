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


def unit_text(args: list[str]) -> str:
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "agentd", *args])
    return f"""[Unit]
Description=agentd: durable AI-agent turns on PostgreSQL
After=network-online.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={command}
Restart=on-failure
RestartSec=2
# SIGTERM starts the two-phase drain; give it the drain budget plus a margin.
TimeoutStopSec=60
KillSignal=SIGTERM

[Install]
WantedBy=default.target
"""


def user_unit_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user" / "agentd.service"
