"""How a client proves who it is: TLS (and a client certificate for mTLS), a bearer token.

`tls_credentials(ca, cert, key)` reads PEM files; `bearer_token` reads a token from a file
(preferred: it stays out of `ps`) or TANDEM_TOKEN. The token travels as `authorization:
Bearer <token>` metadata on every call, added by a client interceptor (gRPC's call
credentials would refuse a plaintext loopback channel).
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import grpc


def tls_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS with `ca` as the roots (system roots when empty), and a client certificate when
    both cert and key are given."""
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both --tls-cert and --tls-key")

    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


def bearer_token(token_file: str = "", token: str = "") -> str:
    """The token: from token_file, else `token`, else TANDEM_TOKEN; "" when none."""
    if token_file:
        return Path(token_file).read_text().strip()
    return token or os.environ.get("TANDEM_TOKEN", "")


class _Details(
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,  # type: ignore[misc]  # grpc is untyped
):
    pass


def _with_token(details: Any, header: tuple[str, str]) -> _Details:
    metadata = [*(details.metadata or ()), header]
    return _Details(
        details.method,
        details.timeout,
        metadata,
        details.credentials,
        getattr(details, "wait_for_ready", None),
        getattr(details, "compression", None),
    )


class BearerToken(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds the token to every call of a sync channel."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def __repr__(self) -> str:  # never the token
        return "BearerToken(<hidden>)"

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_token(details, self._header), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_token(details, self._header), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_with_token(details, self._header), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_with_token(details, self._header), requests)


def aio_interceptors(token: str) -> list[Any]:
    """The same for a grpc.aio channel (one interceptor per call shape)."""
    header = ("authorization", f"Bearer {token}")

    def add(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), header],
            details.credentials,
            details.wait_for_ready,
        )

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
        async def intercept_unary_unary(self, continuation: Any, d: Any, r: Any) -> Any:
            return await continuation(add(d), r)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
        async def intercept_unary_stream(self, continuation: Any, d: Any, r: Any) -> Any:
            return await continuation(add(d), r)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
        async def intercept_stream_unary(self, continuation: Any, d: Any, r: Any) -> Any:
            return await continuation(add(d), r)

    return [UnaryUnary(), UnaryStream(), StreamUnary()]
