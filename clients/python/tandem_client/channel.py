"""What every Tandem client shares: a channel, its lifetime, and gRPC errors as TandemError."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from tandem_client.credentials import TokenChannel, aio_interceptors
from tandem_client.errors import Unavailable, from_rpc_error

T = TypeVar("T")
C = TypeVar("C", bound="GrpcClient")
A = TypeVar("A", bound="AsyncGrpcClient")

# Calls that change nothing (or the same thing again) are retried by gRPC itself when the
# server is UNAVAILABLE (restarting, not yet listening), with exponential backoff.
# Store.Get is not here: grpc-core's retry of a server-streaming call whose connection was
# reset (a store killed mid-call) hangs until the deadline (grpcio 1.7x, reproduced), so the
# clients retry Get themselves (GrpcClient._retry_unavailable).
_IDEMPOTENT = {
    "tandem.v1.Store": ["Lookup"],
    "tandem.v1.StoreAdmin": ["List", "Inspect", "Stats", "Flush"],
    "tandem.v1.Engine": ["Tokenize", "Detokenize", "ModelInfo", "Stats", "Flush"],
}
RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
# Waits between attempts of a client-side retry: RETRY_POLICY's, for the calls it cannot cover.
RETRY_BACKOFFS_S = (0.1, 0.2, 0.4, 0.8)
SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {"name": [{"service": svc, "method": m} for m in methods], "retryPolicy": RETRY_POLICY}
            for svc, methods in _IDEMPOTENT.items()
        ]
    }
)


# Each channel keeps its own connections. gRPC's default pool shares them between all the
# channels of a process to one address, with their reconnect backoff: a client made after
# a server restarted on the same address (tandem up, a test) inherited the old connection's
# "Connection refused" and failed its first call while the server was serving.
OWN_CONNECTIONS = ("grpc.use_local_subchannel_pool", 1)


def channel_options(extra: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    return [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", SERVICE_CONFIG),
        OWN_CONNECTIONS,
        *extra,
    ]


def _open(
    module: Any,
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
    token: str,
) -> Any:
    """A channel from `grpc` or `grpc.aio`, with the retry policy, TLS when credentials,
    and the bearer token on every call when one is given."""
    opts = channel_options(options)
    extra: dict[str, Any] = {}
    if module is grpc.aio and token:
        extra["interceptors"] = aio_interceptors(token)
    if credentials:
        channel = module.secure_channel(address, credentials, opts, **extra)
    else:
        channel = module.insecure_channel(address, opts, **extra)
    if module is grpc and token:
        channel = TokenChannel(channel, token)
    return channel


class GrpcClient:
    def __init__(
        self,
        address: str,
        timeout: float | None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        token: str = "",
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._connection = (credentials, options, token)
        self._channel = _open(grpc, address, credentials, options, token)
        self._others: dict[str, Any] = {}  # channels to other addresses of the same service

    def _channel_to(self, address: str) -> Any:
        """The channel to this address of the same service (made once, with the same
        credentials; closed with the client, as calls of other threads may be using it)."""
        if address == self.address:
            return self._channel
        channel = self._others.get(address)
        if channel is None:
            channel = self._others.setdefault(address, _open(grpc, address, *self._connection))
        return channel

    def close(self) -> None:
        self._channel.close()
        for channel in self._others.values():
            channel.close()

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def _retry_unavailable(self, fn: Callable[[], T]) -> T:
        """fn (an idempotent call) again while it is UNAVAILABLE, with the policy's backoff."""
        for backoff in RETRY_BACKOFFS_S:
            try:
                return fn()
            except Unavailable:
                time.sleep(backoff)
        return fn()


class AsyncGrpcClient:
    """The asyncio twin of GrpcClient (grpc.aio channel, same retries and errors)."""

    def __init__(
        self,
        address: str,
        timeout: float | None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        token: str = "",
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._connection = (credentials, options, token)
        self._channel = _open(grpc.aio, address, credentials, options, token)
        self._others: dict[str, Any] = {}  # channels to other addresses of the same service

    def _channel_to(self, address: str) -> Any:
        """GrpcClient._channel_to's twin."""
        if address == self.address:
            return self._channel
        channel = self._others.get(address)
        if channel is None:
            channel = self._others.setdefault(address, _open(grpc.aio, address, *self._connection))
        return channel

    async def close(self) -> None:
        await self._channel.close()
        for channel in self._others.values():
            await channel.close()

    async def __aenter__(self: A) -> A:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _retry_unavailable(self, fn: Callable[[], Awaitable[T]]) -> T:
        for backoff in RETRY_BACKOFFS_S:
            try:
                return await fn()
            except Unavailable:
                await asyncio.sleep(backoff)
        return await fn()

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
