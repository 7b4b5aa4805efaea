"""The gateway's `tandem.v1.Engine` service: what an engine serves, proxied, so a client
points at the gateway instead of an engine and changes nothing.

Generate goes through the relay (routing, failover); Cancel to the engine running the
request; Tokenize, Detokenize and ModelInfo to a healthy engine; Stats and Flush to every
engine, summed. The caller's bearer token travels on to the engine, which decides tenancy.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from gateway_service.backends import Backend, BackendPool
from gateway_service.relay import Caller, GatewayError, Relay
from tandem_wire.pb import engine_pb2, engine_pb2_grpc

log = logging.getLogger("tandem.gateway")

T = TypeVar("T")
FORWARDED_METADATA = ("authorization",)
UNARY_TIMEOUT_S = 30.0


def caller_of(metadata: Any) -> Caller:
    """The metadata engines must see (the caller's credential) and a scope derived from it."""
    forwarded = tuple(
        (key, value if isinstance(value, str) else value.decode())
        for key, value in (metadata or ())
        if key in FORWARDED_METADATA
    )
    scope = hashlib.sha256(repr(forwarded).encode()).hexdigest()[:32] if forwarded else ""
    return Caller(scope, forwarded)


async def abort_for(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AioRpcError):
        await context.abort(exc.code(), exc.details() or exc.code().name)
    if isinstance(exc, GatewayError):
        await context.abort(exc.code, str(exc))
    raise exc


async def on_any_engine(
    pool: BackendPool,
    caller: Caller,
    call: Callable[[Backend, tuple[tuple[str, str], ...]], Awaitable[T]],
) -> T:
    """A unary call on the least loaded healthy engine, the next one where it is UNAVAILABLE
    or silent; the engine's own refusal (AioRpcError) as it came, or GatewayError
    UNAVAILABLE when no engine answers."""
    for backend in sorted(pool.healthy(), key=lambda b: b.load):
        try:
            return await asyncio.wait_for(call(backend, caller.metadata), UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            pool.mark_down(backend, exc.code().name)
        except TimeoutError:
            pool.mark_down(backend, "no answer")
    raise GatewayError(grpc.StatusCode.UNAVAILABLE, "no engine is serving")


class GatewayServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, pool: BackendPool, relay: Relay) -> None:
        self.pool = pool
        self.relay = relay

    async def Generate(  # noqa: N802 - gRPC's method names
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        caller = caller_of(context.invocation_metadata())
        try:
            async for message in self.relay.generate(request, caller):
                yield message
        except (grpc.aio.AioRpcError, GatewayError) as exc:
            await abort_for(context, exc)

    async def Cancel(  # noqa: N802
        self, request: engine_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.CancelResponse:
        caller = caller_of(context.invocation_metadata())
        try:
            return await self.relay.cancel(request.request_id, caller)
        except (grpc.aio.AioRpcError, GatewayError) as exc:
            await abort_for(context, exc)
            raise

    async def Tokenize(  # noqa: N802
        self, request: engine_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.TokenizeResponse:
        return await self._any(context, lambda b, md: b.stub.Tokenize(request, metadata=md))

    async def Detokenize(  # noqa: N802
        self, request: engine_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.DetokenizeResponse:
        return await self._any(context, lambda b, md: b.stub.Detokenize(request, metadata=md))

    async def ModelInfo(  # noqa: N802
        self, request: engine_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ModelInfoResponse:
        return await self._any(context, lambda b, md: b.stub.ModelInfo(request, metadata=md))

    async def Stats(  # noqa: N802
        self, request: engine_pb2.EngineStatsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineStatsResponse:
        replies = await self._every(context, lambda b, md: b.stub.Stats(request, metadata=md))
        total = engine_pb2.EngineStatsResponse()
        for reply in replies:
            _add_scalars(total, reply)
            total.max_batch_size_seen = max(total.max_batch_size_seen, reply.max_batch_size_seen)
        if replies:
            total.mean_batch_size /= len(replies)
        return total

    async def Flush(  # noqa: N802
        self, request: engine_pb2.EngineFlushRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineFlushResponse:
        replies = await self._every(context, lambda b, md: b.stub.Flush(request, metadata=md))
        total = engine_pb2.EngineFlushResponse()
        for reply in replies:
            _add_scalars(total, reply)
        total.durable = all(r.durable for r in replies)
        return total

    async def _any(
        self,
        context: grpc.aio.ServicerContext,
        call: Callable[[Backend, tuple[tuple[str, str], ...]], Awaitable[T]],
    ) -> T:
        caller = caller_of(context.invocation_metadata())
        try:
            return await on_any_engine(self.pool, caller, call)
        except (grpc.aio.AioRpcError, GatewayError) as exc:
            await abort_for(context, exc)
            raise AssertionError("unreachable") from None

    async def _every(
        self,
        context: grpc.aio.ServicerContext,
        call: Callable[[Backend, tuple[tuple[str, str], ...]], Awaitable[T]],
    ) -> list[T]:
        caller = caller_of(context.invocation_metadata())
        backends = self.pool.healthy()
        if not backends:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine is serving")
        results = await asyncio.gather(
            *(asyncio.wait_for(call(b, caller.metadata), UNARY_TIMEOUT_S) for b in backends),
            return_exceptions=True,
        )
        replies: list[T] = []
        for result in results:
            if isinstance(result, grpc.aio.AioRpcError) and result.code() in (
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED,
            ):
                await abort_for(context, result)
            if isinstance(result, BaseException):
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"an engine did not answer: {result!r}"
                )
                raise result  # abort raised already
            replies.append(result)
        return replies


def _add_scalars(total: Any, reply: Any) -> None:
    """Adds every numeric top-level field (counts and rates sum over engines)."""
    for descriptor, value in reply.ListFields():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(total, descriptor.name, getattr(total, descriptor.name) + value)
