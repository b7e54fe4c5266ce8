"""The `agenttui` command: the TUI, `ask` for scripts, `login` to store a daemon's URL and token.

Textual is imported only when the TUI starts: `ask` and `login` stay light and script-friendly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from agenttui import __version__
from agenttui.ask import EXIT_UNREACHABLE, EXIT_USAGE, ask, report
from agenttui.client import AgentClient, ApiError, Unauthorized, describe
from agenttui.locations import config_file, write_client_config
from agenttui.settings import Settings, SettingsError, load_settings

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
  agenttui login --url http://desk:8740 --token agd_…

exit codes of ask: 0 completed · 1 failed · 2 usage · 3 cancelled · 4 daemon unreachable or
token refused · 130 stopped with Ctrl-C

config file: {config_file()}"""


def _common(parser: argparse.ArgumentParser, *, sub: bool) -> None:
    default: Any = argparse.SUPPRESS if sub else None
    parser.add_argument("--url", default=default,
                        help="agentd's address (default: from the config, "
                             "else http://127.0.0.1:8740)")
    parser.add_argument("--token", default=default,
                        help="device bearer token (default: from the config / $AGENTTUI_TOKEN)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agenttui", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"agenttui {__version__}")
    _common(parser, sub=False)
    parser.add_argument("--conversation", metavar="ID", help="open this conversation")
    parser.add_argument("--theme", help="a Textual theme name (default: agenttui)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

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
    ask_parser.add_argument("text", nargs="*", help="the message (default: read stdin)")

    models = commands.add_parser(
        "models", help="list the models the daemon offers",
        description="The models of the daemon's configured providers: the name to give "
                    "`ask --model` (or the TUI's model picker), the provider kind, and whether "
                    "it can be used now (if not, why).")
    _common(models, sub=True)
    models.add_argument("--json", action="store_true", help="the API's JSON, for scripts")

    login = commands.add_parser(
        "login", help="store a daemon's URL and a device token",
        description=f"Check the token against the daemon (/v1/me) and store URL and token in "
                    f"{config_file()} (mode 0600). Mint a token on the daemon's host with "
                    f"`agentd token create --account A --device D`.")
    login.add_argument("--url", required=True, help="the daemon, e.g. http://desk:8740")
    login.add_argument("--token", required=True, help="the device token (agd_…)")
    login.add_argument("--no-verify", action="store_true",
                       help="store without asking the daemon first")
    return parser


def main(argv: list[str] | None = None) -> None:
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
    raise SystemExit(code)


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(url=getattr(args, "url", None), token=getattr(args, "token", None),
                         conversation=getattr(args, "conversation", None),
                         theme=getattr(args, "theme", None))


def _client(settings: Settings) -> AgentClient:
    return AgentClient(settings.url, settings.token, timeout=settings.timeout_s,
                       stream_timeout=settings.stream_timeout_s)


def _need_token(settings: Settings) -> bool:
    if settings.token:
        return True
    print(f"agenttui: no device token for {settings.url}.\n"
          f"  Run `agenttui login --url URL --token TOKEN` (mint one on the daemon's host with "
          f"`agentd token create --account A --device D`),\n"
          f"  or start agentd on this machine once: it writes {config_file()} for you.",
          file=sys.stderr)
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
                                    show_tools=args.tools)
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
    url = args.url.rstrip("/")
    device = None
    if not args.no_verify:
        async def verify() -> Any:
            async with AgentClient(url, args.token) as client:
                return await client.me()

        try:
            me = asyncio.run(verify())
        except Unauthorized as exc:
            print(f"agenttui: login failed: {url} refused the token ({exc.message})",
                  file=sys.stderr)
            return EXIT_UNREACHABLE
        except ApiError as exc:
            print(f"agenttui: login failed: {describe(exc)}", file=sys.stderr)
            return EXIT_UNREACHABLE
        device = me.device
    path = write_client_config(url, args.token, device=device)
    who = f" as device {device!r} of account {me.account!r}" if device else ""
    print(f"agenttui: logged in to {url}{who}; saved to {path}")
    return 0


def _tui(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not _need_token(settings):
        return EXIT_USAGE
    from agenttui.app import make_app  # Textual loads here, and only here

    app = make_app(settings, _client(settings), close_client=True)
    app.run()
    return app.return_code or 0
