"""What every Tandem client shares: a channel, its lifetime, and gRPC errors as TandemError."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from tandem_client.errors import from_rpc_error

T = TypeVar("T")
C = TypeVar("C", bound="GrpcClient")


class GrpcClient:
    def __init__(
        self,
        address: str,
        timeout: float | None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = (
            grpc.secure_channel(address, credentials, list(options))
            if credentials
            else grpc.insecure_channel(address, list(options))
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
