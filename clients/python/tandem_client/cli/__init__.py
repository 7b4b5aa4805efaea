"""The `tandem` command line.

    tandem up                       start a store and an engine, stream a demo, serve until Ctrl-C
    tandem generate "prompt"        stream a generation (--json for machine output)
    tandem chat                     interactive multi-turn chat
    tandem ckpt ls|show|rm|purge|stats|flush|compact|export|import
                                    manage checkpoints in the store

Addresses come from --engine / --store, else TANDEM_ENGINE / TANDEM_STORE, else the defaults
127.0.0.1:50051 / 127.0.0.1:50061. Exit codes: 0 ok, 2 bad usage or invalid argument,
3 not found, 4 service unreachable, 5 data loss, 6 not authenticated or not allowed, 1 any
other error. Errors are one line on
stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import grpc

from tandem_client.cli import ckpt, generate, up
from tandem_client.cli.output import exit_code, fail
from tandem_client.errors import TandemError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    up.add_parser(sub)
    generate.add_parsers(sub)
    ckpt.add_parser(sub)
    return parser


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except where the help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, default = action.help or "", action.default
        unset = default is None or default is False or default in ([], "", argparse.SUPPRESS)
        if "(default" in text or unset:
            return action.help
        return f"{text} (default: %(default)s)".strip()


class _CommandParser(argparse.ArgumentParser):
    """A command's parser: its --help shows each option's default (nested commands too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsShown)
        super().__init__(*args, **kwargs)


# An engine's address given to a store command, or the other way round.
HINTS = {
    "generate": "is that address a store? engines listen on 127.0.0.1:50051 by default",
    "chat": "is that address a store? engines listen on 127.0.0.1:50051 by default",
    "ckpt": "is that address an engine? the store listens on 127.0.0.1:50061 by default",
}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except TandemError as exc:
        hint = HINTS.get(args.command) if exc.code == grpc.StatusCode.UNIMPLEMENTED else None
        fail(f"{exc} ({hint})" if hint else str(exc))
        code = exit_code(exc)
    except KeyboardInterrupt:
        code = 130
    except (OSError, ValueError) as exc:
        fail(str(exc))
        code = 1
    sys.exit(code)
