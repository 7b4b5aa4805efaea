"""How the CLI reaches a server that wants TLS or a token: the same flags on every command.

A token is read from --token-file (preferred: it stays out of `ps` and shell history) or
TANDEM_TOKEN; there is no --token flag on purpose.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from tandem_client.credentials import bearer_token, tls_credentials


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=os.environ.get("TANDEM_TLS_CA", ""), help="server CA (PEM)")
    p.add_argument("--tls-cert", default=os.environ.get("TANDEM_TLS_CERT", ""), help="client cert")
    p.add_argument("--tls-key", default=os.environ.get("TANDEM_TLS_KEY", ""), help="client key")
    p.add_argument(
        "--token-file",
        default=os.environ.get("TANDEM_TOKEN_FILE", ""),
        help="file holding the bearer token (else env TANDEM_TOKEN)",
    )


def connection(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for StoreClient / EngineClient: credentials and token."""
    tls = args.tls_ca or args.tls_cert
    credentials = tls_credentials(args.tls_ca, args.tls_cert, args.tls_key) if tls else None
    return {"credentials": credentials, "token": bearer_token(args.token_file)}
