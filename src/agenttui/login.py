"""`agenttui login`: pair with a daemon (or take a token from stdin), pin its certificate, save.

Its forms:
  agenttui login URL --code CODE [--fingerprint SHA256:…]   redeem a pairing code
  agenttui login URL --code - [--fingerprint SHA256:…]      the code from stdin (asked for)
  agenttui login URL --token - [--fingerprint SHA256:…]     a token from stdin, never argv
  agenttui login URL --fingerprint SHA256:…                 re-pin the stored token's server
Over https the server's certificate is pinned: given with --fingerprint, or shown and confirmed
on a terminal (trust on first use, as ssh does); without a terminal --fingerprint is required.
Nothing is sent to the server before its certificate is settled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import getpass
import socket
import sys
from dataclasses import dataclass
from typing import TextIO
from urllib.parse import urlsplit

from agentd.fingerprints import BadFingerprint, normalize
from agentd.settings import literal_loopback
from agenttui.ask import EXIT_UNREACHABLE, EXIT_USAGE
from agenttui.client import (
    AgentClient,
    ApiError,
    CertificateMismatch,
    Unauthorized,
    canonical_url,
    describe,
    token_problem,
    url_problem,
)
from agenttui.locations import read_config, write_client_config
from agenttui.pinning import server_fingerprint

TRUST_CAS = "ca"  # --fingerprint ca: a CA-signed certificate (e.g. a reverse proxy's), no pin


class LoginError(Exception):
    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class LoginRequest:
    url: str
    code: str | None = None
    token_from_stdin: bool = False
    fingerprint: str | None = None
    device: str | None = None
    verify: bool = True


def run_login(request: LoginRequest, *, stdin: TextIO = sys.stdin,
              stderr: TextIO = sys.stderr) -> int:
    try:
        message = asyncio.run(_login(request, stdin, stderr))
    except LoginError as exc:
        print(f"agenttui: login failed: {exc}", file=stderr)
        return exc.code
    print(f"agenttui: {message}")
    return 0


def checked_url(url: str) -> str:
    problem = url_problem(url)
    if problem is not None:
        raise LoginError(problem)
    return canonical_url(url)


async def _login(request: LoginRequest, stdin: TextIO, stderr: TextIO) -> str:
    url = checked_url(request.url)
    if request.code and request.token_from_stdin:
        raise LoginError("give either --code or --token -, not both")
    stored = read_config()
    if not request.code and not request.token_from_stdin:
        if not request.fingerprint:
            raise LoginError("give --code CODE (from `agentd pair`), --token - (a token on "
                             "stdin), or --fingerprint to re-pin the stored server")
        if stored.get("url") != url or not isinstance(stored.get("token"), str):
            raise LoginError(f"no stored token for {url}: log in with --code or --token -")
    token = _read_token(stdin) if request.token_from_stdin else None
    if request.code == "-":
        # Off the command line, where every local user could read it while this waits (the
        # trust prompt) and redeem it first.
        request = dataclasses.replace(request, code=_read_code(stdin, stderr))
    pin = await _settle_pin(url, request, stdin, stderr)
    device = request.device or socket.gethostname() or "agenttui"
    try:
        if request.code:
            async with AgentClient(url, fingerprint=pin, trust_env=False) as client:
                paired = await client.pair(request.code, device)
            token, device, account = paired["token"], paired["device"], paired["account"]
        else:
            token = token or str(stored["token"])
            account = None
            if request.verify:
                async with AgentClient(url, token, fingerprint=pin, trust_env=False) as client:
                    me = await client.me()
                device, account = me.device, me.account
            elif not request.token_from_stdin:
                device = str(stored.get("device") or device)
    except CertificateMismatch as exc:
        raise LoginError(f"{url} presented certificate {exc.presented}, not the expected "
                         f"{exc.pinned}; nothing was sent. Check the fingerprint `agentd "
                         "pair` printed on the server.", EXIT_UNREACHABLE) from None
    except Unauthorized as exc:
        what = "pairing code" if request.code else "token"
        raise LoginError(f"{url} refused the {what}: {exc.message}", EXIT_UNREACHABLE) \
            from None
    except ApiError as exc:
        raise LoginError(describe(exc), EXIT_UNREACHABLE) from None
    path = write_client_config(url, token, device=device, fingerprint=pin)
    who = f" as device {device!r}" + (f" of account {account!r}" if account else "")
    pinned = f"; pinned {pin}" if pin else ""
    return f"logged in to {url}{who}{pinned}; saved to {path} (mode 0600)"


def _read_code(stdin: TextIO, stderr: TextIO) -> str:
    """`--code -`: the pairing code, one line of stdin (asked for on a terminal)."""
    if stdin.isatty():
        print("Pairing code (from `agentd pair`): ", end="", file=stderr, flush=True)
    code = stdin.readline().strip()
    if not code or any(c.isspace() for c in code):
        raise LoginError("stdin held no pairing code (one line, e.g. 7K3QX-M9V2D)")
    return code


def _read_token(stdin: TextIO) -> str:
    raw = getpass.getpass("device token (not echoed): ") if stdin.isatty() else stdin.read()
    token = raw.strip()
    if not token or any(c.isspace() for c in token):
        raise LoginError("stdin held no token (one line, e.g. from `agentd token create`)")
    problem = token_problem(token)
    if problem is not None:
        raise LoginError(f"stdin held no usable token: {problem}")
    return token


async def _settle_pin(url: str, request: LoginRequest, stdin: TextIO,
                      stderr: TextIO) -> str | None:
    """The fingerprint to pin for `url` (None for plain http), confirmed before any request."""
    if not url.startswith("https://"):
        if request.fingerprint:
            raise LoginError("--fingerprint pins a TLS certificate: use the https:// URL")
        if not _loopback(url):
            print(f"agenttui: warning: {url} is not encrypted: the code and the token cross "
                  "the network in clear text", file=stderr)
        return None
    if request.fingerprint and request.fingerprint.lower() == TRUST_CAS:
        return None  # no pin: the system's CAs and the host name decide, at every connection
    if request.fingerprint:
        try:
            return normalize(request.fingerprint)
        except BadFingerprint as exc:
            raise LoginError(str(exc)) from None
    try:
        presented = await server_fingerprint(url)
    except (OSError, TimeoutError, ValueError) as exc:
        raise LoginError(f"cannot reach {url}: {exc}", EXIT_UNREACHABLE) from None
    if not stdin.isatty():
        raise LoginError(f"{url} presents certificate {presented}; not on a terminal, so "
                         "nothing is trusted unasked: pass --fingerprint with the fingerprint "
                         "`agentd pair` printed on the server")
    print(f"The server at {url} presents the certificate\n  {presented}\n"
          "Compare it with the fingerprint `agentd pair` printed on the server.", file=stderr)
    print("Trust and pin it? [y/N] ", end="", file=stderr, flush=True)
    answer = stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise LoginError("not trusted; nothing was sent to the server")
    return presented


def _loopback(url: str) -> bool:
    return literal_loopback(urlsplit(url).hostname or "")
