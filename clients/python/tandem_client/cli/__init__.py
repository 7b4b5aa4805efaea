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

from tandem_client.cli import ckpt, generate, up
from tandem_client.cli.output import exit_code, fail
from tandem_client.errors import TandemError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up.add_parser(sub)
    generate.add_parsers(sub)
    ckpt.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except TandemError as exc:
        fail(str(exc))
        code = exit_code(exc)
    except KeyboardInterrupt:
        code = 130
    except (OSError, ValueError) as exc:
        fail(str(exc))
        code = 1
    sys.exit(code)
