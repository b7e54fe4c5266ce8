"""The `agenttui` command: the TUI, `ask` for scripts, `login` to store a daemon's URL and token.

Textual is imported only when the TUI starts: `ask` and `login` stay light and script-friendly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any, NoReturn

from agenttui import __version__
from agenttui.ask import EXIT_UNREACHABLE, EXIT_USAGE, Approver, ask, report
from agenttui.client import DEFAULT_URL, AgentClient, ApiError, Unauthorized, describe
from agenttui.locations import config_file, read_config
from agenttui.settings import Settings, SettingsError, load_settings, same_daemon

DESCRIPTION = """\
agenttui — a terminal client for agentd. Several devices can attach to one conversation: each
sees who owns it, the answer streaming live, queued turns, and can stop the run.

With no command, opens the TUI. Settings come from the config file (written by
`agenttui login`, or by agentd on its first local start), AGENTTUI_* variables, then flags."""

EPILOG = f"""\
examples:
  agenttui                                   open the TUI (most recent conversation)
  agenttui --conversation 0b6e…              open one conversation
  agenttui ask "summarize the last deploy"   stream one answer to stdout
  agenttui models                            the models on offer (for ask --model)
  echo "hello" | agenttui ask --conversation last
  agenttui login https://desk:8740 --code 7K3QX-M9V2D --fingerprint SHA256:…
                                             pair with the line `agentd pair` prints
  agentd token create --account me --device ci | agenttui login http://127.0.0.1:8740 --token -

exit codes of ask: 0 completed · 1 failed · 2 usage · 3 cancelled · 4 daemon unreachable or
token refused · 130 stopped with Ctrl-C

config file: {config_file()}"""


def _common(parser: argparse.ArgumentParser, *, sub: bool) -> None:
    default: Any = argparse.SUPPRESS if sub else None
    parser.add_argument("--url", default=default,
                        help="agentd's address (default: from the config, "
                             "else http://127.0.0.1:8740)")
    # Kept only to refuse it clearly: a token given here would be visible to every local user
    # (in the process list) and kept in shell history.
    parser.add_argument("--token", default=default,
                        help="not accepted: the device token comes from the config (`agenttui "
                             "login`) or $AGENTTUI_TOKEN, never from the command line")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the full usage is one --help away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="agenttui", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"agenttui {__version__}")
    _common(parser, sub=False)
    parser.add_argument("--conversation", metavar="ID", help="open this conversation")
    parser.add_argument("--theme", help="a Textual theme name (default: agenttui)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    ask_parser = commands.add_parser(
        "ask", help="stream one answer to stdout", formatter_class=argparse.RawTextHelpFormatter,
        description="Queue one turn and stream the assistant's answer to stdout (only the "
                    "answer:\nprogress and errors go to stderr). Ctrl-C stops the run on the "
                    "server.\nExit 0 when the run completed, non-zero otherwise.")
    _common(ask_parser, sub=True)
    ask_parser.add_argument("--conversation", metavar="ID", default=argparse.SUPPRESS,
                            help="continue this conversation ('last' = the most recent); "
                                 "default: a new one")
    ask_parser.add_argument("--model", help="provider:model for this turn, and for the "
                                            "conversation when ask creates it (default: the "
                                            "conversation's model, else the daemon's default; "
                                            "`agenttui models` lists them)")
    ask_parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                            help="a provider parameter (JSON value), e.g. --param tokens=80")
    ask_parser.add_argument("--tools", action=argparse.BooleanOptionalAction, default=None,
                            help="show tool calls on stderr (default: when stderr is a "
                                 "terminal)")
    ask_parser.add_argument("--raw", action="store_true",
                            help="write the model's text as it came, control characters "
                                 "included\n(default: on a terminal, drop every control "
                                 "character but\nnewline and tab; pipes and files always get "
                                 "it as it came)")
    ask_parser.add_argument("--approve-all", action="store_true",
                            help="approve every tool call that asks for approval, without "
                                 "asking (for scripts; each one is announced on stderr). "
                                 "Without it, calls are asked about on the terminal, or "
                                 "denied when stdin is not one")
    ask_parser.add_argument("text", nargs="*", help="the message (default: read stdin)")

    models = commands.add_parser(
        "models", help="list the models the daemon offers",
        description="The models of the daemon's configured providers: the name to give "
                    "`ask --model` (or the TUI's model picker), the provider kind, and whether "
                    "it can be used now (if not, why).")
    _common(models, sub=True)
    models.add_argument("--json", action="store_true", help="the API's JSON, for scripts")

    login = commands.add_parser(
        "login", help="pair with a daemon (or store a token) and pin its certificate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"""\
Attach this machine to an agentd and save url, token and pinned certificate in
{config_file()} (mode 0600).

  agenttui login URL --code CODE [--fingerprint SHA256:…]   pair with a one-time code
  agenttui login URL --code - [--fingerprint SHA256:…]      the same, the code asked for
  agenttui login URL --token - [--fingerprint SHA256:…]     a token read from stdin
  agenttui login URL --fingerprint SHA256:…                 re-pin the stored server

Get a code and the exact line on the daemon's host with
`agentd pair --account A --device D`, or from a logged-in TUI ("Pair another device").
Over https the certificate is pinned: without --fingerprint you are shown it and asked
(trust on first use); without a terminal, --fingerprint is required.""")
    login.add_argument("url", nargs="?", metavar="URL", help="the daemon, e.g. "
                       "https://desk.lan:8740")
    login.add_argument("--url", dest="url_option", metavar="URL", help="the same, as an option")
    login.add_argument("--code", help="a one-time pairing code, e.g. 7K3QX-M9V2D; `-`: read "
                       "it from stdin (asked for on a terminal), off the command line where "
                       "other local users can read it")
    login.add_argument("--token", metavar="-", help="`-`: read a device token from stdin "
                       "(a token is never taken from the command line)")
    login.add_argument("--fingerprint", metavar="SHA256:…",
                       help="the server certificate's fingerprint to pin (`ca`: no pin, trust "
                            "a CA-signed certificate and the host name instead)")
    login.add_argument("--device", help="this device's name (default: the host name)")
    login.add_argument("--no-verify", action="store_true",
                       help="with --token: store without asking the daemon first")
    return parser


def main(argv: list[str] | None = None) -> None:
    """A bad value, an unreachable daemon or a refusal ends in one `agenttui: …` line and a
    non-zero exit, never a traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "ask":
            code = _ask(args)
        elif args.command == "models":
            code = _models(args)
        elif args.command == "login":
            code = _login(args)
        else:
            code = _tui(args)
    except SettingsError as exc:
        print(f"agenttui: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except ApiError as exc:
        print(f"agenttui: {describe(exc)}", file=sys.stderr)
        code = EXIT_UNREACHABLE
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:  # a bug: still one line, naming what failed
        print(f"agenttui: {args.command or 'tui'} failed: {describe(exc)}", file=sys.stderr)
        code = 1
    raise SystemExit(code)


def _settings(args: argparse.Namespace) -> Settings:
    if getattr(args, "token", None) is not None:
        raise SettingsError("a token on the command line would be visible to every local user "
                            "and kept in shell history: set AGENTTUI_TOKEN, or store it with "
                            "`agenttui login URL --token -`")
    return load_settings(url=getattr(args, "url", None),
                         conversation=getattr(args, "conversation", None),
                         theme=getattr(args, "theme", None))


def _client(settings: Settings) -> AgentClient:
    return AgentClient(settings.url, settings.token, timeout=settings.timeout_s,
                       stream_timeout=settings.stream_timeout_s,
                       fingerprint=settings.fingerprint)


def _need_token(settings: Settings) -> bool:
    if settings.token:
        return True
    stored = read_config()
    if stored.get("token") and not same_daemon(str(stored.get("url", DEFAULT_URL)),
                                               settings.url):
        print(f"agenttui: the stored token is for {stored.get('url', DEFAULT_URL)}, not "
              f"{settings.url} (a token goes only to the daemon it was stored for): run "
              f"`agenttui login {settings.url} …` for this one, or set AGENTTUI_TOKEN",
              file=sys.stderr)
        return False
    print(f"agenttui: no device token for {settings.url}: run the `agenttui login URL --code "
          f"CODE --fingerprint SHA256:…` line that `agentd pair --account A --device D` prints "
          f"on the daemon's host, or start agentd on this machine once (it writes "
          f"{config_file()} for you)", file=sys.stderr)
    return False


def _params(items: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SettingsError(f"--param {item!r} must look like KEY=VALUE")
        try:
            params[key] = json.loads(raw)
        except ValueError:
            params[key] = raw
    return params


def _ask(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not _need_token(settings):
        return EXIT_USAGE
    text = " ".join(args.text)
    if not text or text == "-":
        text = sys.stdin.read()
    if not text.strip():
        print("agenttui: nothing to ask (give TEXT or pipe it on stdin)", file=sys.stderr)
        return EXIT_USAGE
    params = {**settings.params, **_params(args.param)}

    async def run() -> int:
        async with _client(settings) as client:
            try:
                outcome = await ask(client, text, conversation=getattr(args, "conversation",
                                                                         None) or None,
                                    model=args.model or settings.model, params=params,
                                    show_tools=args.tools, raw=args.raw,
                                    approver=Approver(approve_all=args.approve_all))
            except Unauthorized as exc:
                print(f"agenttui: the daemon refused the token: {exc.message} "
                      f"(run `agenttui login`)", file=sys.stderr)
                return EXIT_UNREACHABLE
            except ApiError as exc:
                print(f"agenttui: {describe(exc)}", file=sys.stderr)
                return EXIT_UNREACHABLE if exc.status in (0, 502, 503, 504) else EXIT_USAGE
            report(outcome, sys.stderr)
            return outcome.exit_code

    return asyncio.run(run())


def _models(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not _need_token(settings):
        return EXIT_USAGE

    async def run() -> int:
        async with _client(settings) as client:
            try:
                models = await client.list_models()
            except ApiError as exc:
                print(f"agenttui: {describe(exc)}", file=sys.stderr)
                return EXIT_UNREACHABLE
        if args.json:
            print(json.dumps({"default_model": models.default_model, "models": [
                {"name": m.name, "provider": m.provider, "kind": m.kind, "usable": m.usable,
                 "reason": m.reason} for m in models.offers]}, indent=2))
            return 0
        width = max((len(m.name) for m in models.offers), default=0)
        for offer in models.offers:
            state = "usable" if offer.usable else f"not usable: {offer.reason}"
            default = " (default)" if offer.name == models.default_model else ""
            print(f"{offer.name:<{width}}  {offer.kind:<9}  {state}{default}")
        return 0

    return asyncio.run(run())


def _login(args: argparse.Namespace) -> int:
    from agenttui.login import LoginRequest, run_login

    if args.url and args.url_option and args.url != args.url_option:
        print("agenttui: give the URL once (URL or --url)", file=sys.stderr)
        return EXIT_USAGE
    url = args.url or args.url_option
    if not url:
        print("agenttui: login needs the daemon's URL", file=sys.stderr)
        return EXIT_USAGE
    if args.token is not None and args.token != "-":
        print("agenttui: a token on the command line would be visible to every local user "
              "and kept in shell history: use --token - and pipe it in", file=sys.stderr)
        return EXIT_USAGE
    return run_login(LoginRequest(url=url, code=args.code, token_from_stdin=args.token == "-",
                                  fingerprint=args.fingerprint, device=args.device,
                                  verify=not args.no_verify))


def _tui(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not _need_token(settings):
        return EXIT_USAGE
    from agenttui.app import make_app  # Textual loads here, and only here

    app = make_app(settings, _client(settings), close_client=True)
    app.run()
    return app.return_code or 0
