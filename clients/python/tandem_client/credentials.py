"""How a client proves who it is: TLS (and a client certificate for mTLS), a bearer token.

`tls_credentials(ca, cert, key)` reads PEM files; `bearer_token` reads a token from a file
(preferred: it stays out of `ps`) or TANDEM_TOKEN. The token travels as `authorization:
Bearer <token>` metadata on every call, added by the channel (gRPC's call credentials would
refuse a plaintext loopback channel).
"""

from __future__ import annotations

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


class _WithToken:
    """A multicallable that adds the token to each call's metadata."""

    def __init__(self, inner: Any, header: tuple[str, str]) -> None:
        self._inner = inner
        self._header = header

    def _metadata(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs["metadata"] = (*(kwargs.get("metadata") or ()), self._header)
        return kwargs

    def __call__(self, request: Any, **kwargs: Any) -> Any:
        return self._inner(request, **self._metadata(kwargs))

    def with_call(self, request: Any, **kwargs: Any) -> Any:
        return self._inner.with_call(request, **self._metadata(kwargs))

    def future(self, request: Any, **kwargs: Any) -> Any:
        return self._inner.future(request, **self._metadata(kwargs))


class TokenChannel:
    """A sync channel whose every call carries the token.

    Hand-written because grpc.intercept_channel cost ~95 us per call here (a small Lookup is
    ~900 us); this adds one tuple per call.
    """

    def __init__(self, channel: grpc.Channel, token: str) -> None:
        self._channel = channel
        self._header = ("authorization", f"Bearer {token}")

    def __repr__(self) -> str:  # never the token
        return f"TokenChannel({self._channel!r}, <token hidden>)"

    def unary_unary(self, *args: Any, **kwargs: Any) -> _WithToken:
        return _WithToken(self._channel.unary_unary(*args, **kwargs), self._header)

    def unary_stream(self, *args: Any, **kwargs: Any) -> _WithToken:
        return _WithToken(self._channel.unary_stream(*args, **kwargs), self._header)

    def stream_unary(self, *args: Any, **kwargs: Any) -> _WithToken:
        return _WithToken(self._channel.stream_unary(*args, **kwargs), self._header)

    def stream_stream(self, *args: Any, **kwargs: Any) -> _WithToken:
        return _WithToken(self._channel.stream_stream(*args, **kwargs), self._header)

    def __getattr__(self, name: str) -> Any:  # close, subscribe, ...
        return getattr(self._channel, name)


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
