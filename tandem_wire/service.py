"""What both server processes share: logging, server options, and requests that cannot be
parsed answered INVALID_ARGUMENT on every RPC.

grpc turns a deserializer that raises into INTERNAL ("Exception deserializing request!") on
the sync server and UNKNOWN on the asyncio one: a caller's malformed bytes would read as our
bug. `guarded(server)` stands in for the server while the generated `add_*_to_server`
functions (and health, reflection, our own generic handlers) register, and wraps every
handler once: its deserializer never raises (a failure becomes a `MalformedRequest`), and a
unary request that is one is refused with INVALID_ARGUMENT before the method runs. For
request streams the method sees the `MalformedRequest` among its messages and refuses it
itself (the store's Put does).
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# One server per port: gRPC binds with SO_REUSEPORT by default on Linux, so a second server on
# a busy port would start and share its traffic with the first.
SERVER_OPTIONS: list[tuple[str, Any]] = [("grpc.so_reuseport", 0)]


def configure_logging(level: int = logging.INFO) -> None:
    """Logs go to stderr (stdout carries only the `listening on` banner)."""
    logging.basicConfig(level=level, stream=sys.stderr, format=LOG_FORMAT)


class MalformedRequest:
    """What a request message that could not be parsed deserializes to."""

    def __init__(self, error: str) -> None:
        self.error = error

    def message(self, method: str) -> str:
        return f"{method}: the request could not be parsed ({self.error})"


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - the caller's bytes, answered as such
            return MalformedRequest(f"{type(exc).__name__}: {exc}")

    return parse


def _guard_sync(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
        return behavior(request, context)

    return call


def _guard_async(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, MalformedRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
            async for response in behavior(request, context):
                yield response

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
        return await behavior(request, context)

    return unary


def _guard(handler: Any, method: str, asynchronous: bool) -> Any:
    """The handler with a deserializer that never raises (grpc's RpcMethodHandler is a
    namedtuple: `_replace` is its public copy-with)."""
    guarded = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
    if handler.request_streaming:
        return guarded
    guard = _guard_async if asynchronous else _guard_sync
    if handler.unary_unary is not None:
        return guarded._replace(unary_unary=guard(handler.unary_unary, method))
    return guarded._replace(unary_stream=guard(handler.unary_stream, method))


class _GuardedGeneric(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc is untyped
    def __init__(self, inner: grpc.GenericRpcHandler, asynchronous: bool) -> None:
        self.inner = inner
        self.asynchronous = asynchronous

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = self.inner.service(handler_call_details)
        if handler is None:
            return None
        return _guard(handler, handler_call_details.method, self.asynchronous)


class guarded:  # noqa: N801 - used like a function: guarded(server)
    """Registers handlers on `server` with malformed requests refused (see the module doc)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.asynchronous = isinstance(server, grpc.aio.Server)

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self.server.add_generic_rpc_handlers(
            [_GuardedGeneric(h, self.asynchronous) for h in handlers]
        )

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Any]) -> None:
        self.server.add_registered_method_handlers(
            service,
            {
                name: _guard(h, f"/{service}/{name}", self.asynchronous)
                for name, h in handlers.items()
            },
        )
