"""How the CLI prints: rich tables for people, JSON for scripts, one-line errors, exit codes."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import grpc
from rich.console import Console
from rich.table import Table

from tandem_client.errors import TandemError

console = Console(highlight=False)
errors = Console(stderr=True, highlight=False)

_EXIT = {
    grpc.StatusCode.INVALID_ARGUMENT: 2,
    grpc.StatusCode.NOT_FOUND: 3,
    grpc.StatusCode.UNAVAILABLE: 4,
    grpc.StatusCode.DEADLINE_EXCEEDED: 4,
    grpc.StatusCode.DATA_LOSS: 5,
    grpc.StatusCode.UNAUTHENTICATED: 6,
    grpc.StatusCode.PERMISSION_DENIED: 6,
}


def exit_code(exc: TandemError) -> int:
    return _EXIT.get(exc.code, 1)


def fail(message: str) -> None:
    """One clear line on stderr, no traceback."""
    errors.print(f"tandem: error: {message}", markup=False, soft_wrap=True)


def engine_address(value: str | None) -> str:
    return value or os.environ.get("TANDEM_ENGINE", "127.0.0.1:50051")


def store_address(value: str | None) -> str:
    return value or os.environ.get("TANDEM_STORE", "127.0.0.1:50061")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(ms: int, now_ms: int) -> str:
    seconds = max(0, (now_ms - ms) // 1000)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A table for a terminal; in a pipe, a `# title` line, a header and tab-separated rows
    (cut, awk and sort read them, and no cell is wrapped at 80 columns)."""
    if not console.is_terminal:
        sys.stdout.write(f"# {title}\n" + "\t".join(columns) + "\n")
        for row in rows:
            sys.stdout.write("\t".join(row) + "\n")
        return
    t = Table(title=title, title_justify="left")
    for column in columns:
        # Keys and ids stay whole (no folding); other cells may fold to fit the width.
        t.add_column(column, overflow="fold", no_wrap=column in ("key", "model"))
    for row in rows:
        t.add_row(*row)
    console.print(t)
