"""The flag blocks the three servers share (engine, store, gateway), written once.

Each server builds its own argparse parser; every flag's default comes from the server's
environment (`EnvDefaults("TANDEM_ENGINE_")`: `--auth-file` from TANDEM_ENGINE_AUTH_FILE)
and is read when the parser is built. A block adds a group of flags at the point in the
parser where it is called, so each server keeps its own order in `--help`.

The blocks whose flags land in a server's config under their own names have a frozen
dataclass naming those fields, their types and defaults (`TlsFlags`, `AuthFlags`,
`LogFlags`, `MetricsFlags`); `config_fields(args, TlsFlags, ...)` reads them out of the
parsed namespace as keyword arguments for the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from tandem_wire.logs import LOG_FORMATS, LOG_LEVELS

LISTEN_HELP = "HOST:PORT; port 0 picks a free one (printed on start)"
AUTH_FILE_HELP = "JSON file of principals (docs/security.md); reloaded on SIGHUP"
INSECURE_NO_AUTH_HELP = "allow a non-loopback address without --auth-file"
METRICS_LISTEN_HELP = "serve Prometheus /metrics on HOST:PORT (default: off)"


class EnvDefaults:
    """Flag defaults from the environment variables `prefix + NAME`, read at each call.

    `env(NAME, default)` is the variable's text; `integer`, `real`, `flag` and
    `on_unless_zero` convert it the way every server's flags do. An unset variable gives the
    default; one that does not convert raises ValueError while the parser is built.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, name: str, default: str) -> str:
        return os.environ.get(self.prefix + name, default)

    def integer(self, name: str, default: int) -> int:
        return int(self(name, str(default)))

    def real(self, name: str, default: float) -> float:
        return float(self(name, str(default)))

    def flag(self, name: str) -> bool:
        """Off unless the variable is "1" (store_true flags)."""
        return self(name, "") == "1"

    def on_unless_zero(self, name: str) -> bool:
        """On unless the variable is "0" (--no-NAME switches)."""
        return self(name, "1") != "0"


@dataclass(frozen=True)
class TlsFlags:
    """add_tls_args: PEM files; cert and key both given = TLS; a client CA = mTLS."""

    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""


@dataclass(frozen=True)
class AuthFlags:
    """add_auth_args: principals (docs/security.md), and the explicit opt-out that allows a
    non-loopback address without them."""

    auth_file: str = ""
    insecure_no_auth: bool = False


@dataclass(frozen=True)
class LogFlags:
    """add_log_args: how the server logs (tandem_wire/logs.py)."""

    log_format: str = "text"  # or "json"
    log_level: str = "info"


@dataclass(frozen=True)
class MetricsFlags:
    """add_metrics_arg: Prometheus /metrics on HOST:PORT; "" = off."""

    metrics_listen: str = ""


Block = type[TlsFlags] | type[AuthFlags] | type[LogFlags] | type[MetricsFlags]


def config_fields(args: argparse.Namespace, *blocks: Block) -> dict[str, Any]:
    """The parsed values of the blocks' fields, as keyword arguments for a server's config."""
    return {f.name: getattr(args, f.name) for block in blocks for f in dataclasses.fields(block)}


def add_listen_arg(p: argparse.ArgumentParser, env: EnvDefaults, default: str) -> None:
    """--listen HOST:PORT (env LISTEN) for a server with one gRPC address."""
    p.add_argument("--listen", default=env("LISTEN", default), help=LISTEN_HELP)


def add_tls_args(p: argparse.ArgumentParser, env: EnvDefaults) -> None:
    """--tls-cert, --tls-key, --tls-client-ca (env TLS_CERT, TLS_KEY, TLS_CLIENT_CA)."""
    p.add_argument("--tls-cert", default=env("TLS_CERT", ""), help="PEM certificate")
    p.add_argument("--tls-key", default=env("TLS_KEY", ""), help="PEM private key")
    p.add_argument(
        "--tls-client-ca",
        default=env("TLS_CLIENT_CA", ""),
        help="PEM CA bundle: clients must present a certificate it signed (mTLS)",
    )


def add_auth_args(
    p: argparse.ArgumentParser,
    env: EnvDefaults,
    *,
    auth_help: str | None = AUTH_FILE_HELP,
    insecure_help: str = INSECURE_NO_AUTH_HELP,
) -> None:
    """--auth-file PATH and --insecure-no-auth (env AUTH_FILE, INSECURE_NO_AUTH=1)."""
    p.add_argument("--auth-file", default=env("AUTH_FILE", ""), help=auth_help)
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        default=env.flag("INSECURE_NO_AUTH"),
        help=insecure_help,
    )


def add_log_args(p: argparse.ArgumentParser, env: EnvDefaults) -> None:
    """--log-format text|json and --log-level (env LOG_FORMAT, LOG_LEVEL)."""
    p.add_argument("--log-format", choices=LOG_FORMATS, default=env("LOG_FORMAT", "text"))
    p.add_argument("--log-level", choices=LOG_LEVELS, default=env("LOG_LEVEL", "info"))


def add_metrics_arg(p: argparse.ArgumentParser, env: EnvDefaults) -> None:
    """--metrics-listen HOST:PORT (env METRICS_LISTEN); empty = no /metrics."""
    p.add_argument("--metrics-listen", default=env("METRICS_LISTEN", ""), help=METRICS_LISTEN_HELP)


def add_valkey_args(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    env: EnvDefaults,
    name: str,
    what: str,
) -> None:
    """--NAME valkey://... and --NAME-password-file (env NAME, NAME_PASSWORD_FILE): a Valkey
    cluster the server talks to for `what` (the tier, the registry). The password is read
    from a file so it is never in argv or a log; tandem_wire.registry.ValkeyTarget parses
    both."""
    env_name = name.upper().replace("-", "_")
    p.add_argument(
        "--" + name,
        default=env(env_name, ""),
        help=f"valkey://[USER@]HOST:PORT[,HOST:PORT...] of {what} (valkeys:// for TLS); "
        "default: none",
    )
    p.add_argument(
        f"--{name}-password-file",
        default=env(env_name + "_PASSWORD_FILE", ""),
        help=f"file holding the {name} user's password (never on the command line)",
    )


def add_grace_arg(p: argparse.ArgumentParser, env: EnvDefaults, help: str | None = None) -> None:
    """--grace SECONDS (env GRACE, default 10): how long SIGTERM waits; dest `grace`."""
    p.add_argument("--grace", type=float, default=env.real("GRACE", 10), help=help)


def add_off_switch(p: argparse.ArgumentParser, env: EnvDefaults, dest: str, help: str) -> None:
    """--no-NAME for a feature that is on unless that flag or the variable NAME=0 says no."""
    p.add_argument(
        "--no-" + dest.replace("_", "-"),
        dest=dest,
        action="store_false",
        default=env.on_unless_zero(dest.upper()),
        help=help,
    )
