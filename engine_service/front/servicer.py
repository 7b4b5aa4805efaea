"""The gRPC face of the engine (grpc.aio): wire -> domain -> wire, one error path.

Runs in the front process. Each RPC converts its request (front/wire.py), asks the engine core
(front/core_link.py: planning, admission, the batch, checkpoints all live there), turns its events
into text (front/response_stream.py), and converts the result back. Engine errors map to their
status code in `rpc_status`, for unary and streaming RPCs alike; anything else is logged and
is INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from engine_service.errors import EngineError, NotFound
from engine_service.front import wire, wire_out
from engine_service.front.core_link import CoreLink
from engine_service.front.metrics import RequestMetrics
from engine_service.front.policy import RequestPolicy
from engine_service.front.reasoning import reasoning_split
from engine_service.front.response_stream import Backpressure, RequestStream, ResponseChunk, respond
from engine_service.front.tool_calls import tool_call_split
from engine_service.front.tool_wire import tool_use_from_pb
from engine_service.protocol.requests import GenerationRequest, scoped_id
from tandem_wire.auth import AuthError, current, namespace_for
from tandem_wire.pb import engine_pb2, engine_pb2_grpc
from tandem_wire.service import Access

log = logging.getLogger(__name__)
requests_log = logging.getLogger("tandem.engine.requests")
F = TypeVar("F", bound=Callable[..., Any])


@contextlib.asynccontextmanager
async def rpc_status(context: grpc.aio.ServicerContext, rpc: str) -> AsyncIterator[None]:
    """The one mapping of errors to status codes (aborting the call ends it)."""
    try:
        yield
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except EngineError as exc:
        await context.abort(exc.code, str(exc))
    except AuthError as exc:  # a namespace the caller may not use
        await context.abort(grpc.StatusCode[exc.status], str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug: logged, then INTERNAL
        log.exception("%s failed", rpc)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {rpc}: {exc}")


def unary(method: F) -> F:
    @functools.wraps(method)
    async def call(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with rpc_status(context, method.__name__):
            return await method(self, request, context)

    return call  # type: ignore[return-value]


async def _inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _owner() -> str:
    """Whose requests these are: the calling principal (auth), else everyone's."""
    principal = current()
    return principal.name if principal is not None else ""


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(
        self,
        policy: RequestPolicy,
        core: CoreLink,
        park_after_tokens: int,
        access: Access | None = None,
        metrics: RequestMetrics | None = None,
        log_prompts: bool = False,
    ) -> None:
        self.policy = policy
        self.metrics = metrics
        self.log_prompts = log_prompts
        self.access = access
        self.loaded = policy.loaded
        self.core = core
        self.park_after_tokens = park_after_tokens
        self._aborts: set[asyncio.Task[None]] = set()  # calls being ended (kept referenced)

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        arrival = time.monotonic()
        async with rpc_status(context, "Generate"):
            req = await self._request(request, context, arrival)
            events = RequestStream(self._backpressure(req, context))
            stream = self.core.open_stream(events)
            completed, last = False, None
            try:
                # The core plans (a cached prefix, a checkpoint to resume) and admits it.
                accepted = await self.core.submit(stream, req)
                chunks = respond(
                    req,
                    self.loaded.tokenizer,
                    events,
                    arrival,
                    accepted.replay,
                    self._stopper(req),
                    self.metrics,
                    reasoning_split(self.loaded.tokenizer, req.prompt, bool(request.messages)),
                    tool_call_split(tool_use_from_pb(request), self.loaded.tokenizer, req.shown_id),
                    accepted.replay_tokens,
                )
                async for chunk in chunks:
                    last = chunk
                    yield wire_out.response_to_pb(chunk)
                completed = True
            finally:
                # Not completed: the client went away or the deadline passed. The row is
                # freed, its checkpoint kept so the client can resume.
                self.core.close_stream(stream, drop=not completed)
                _log_request(req, last, arrival, self.log_prompts)

    async def _request(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext, arrival: float
    ) -> GenerationRequest:
        remaining = context.time_remaining()
        deadline = arrival + remaining if remaining is not None else None
        request.namespace = namespace_for(request.namespace)  # PermissionDenied (auth)
        # Tokenizing runs off the event loop; token-id prompts are only checked, inline,
        # saving two thread hand-offs.
        convert = asyncio.to_thread if wire.needs_tokenizer(request) else _inline
        req: GenerationRequest = await convert(wire.request_from_pb, request, self.policy, deadline)
        return dataclasses.replace(req, request_id=scoped_id(_owner(), req.request_id))

    def _backpressure(
        self, req: GenerationRequest, context: grpc.aio.ServicerContext
    ) -> Backpressure | None:
        """A client that stops reading parks its row; one that stays away is cut off."""
        limit = self.park_after_tokens
        if not limit:
            return None
        rid = req.request_id

        def abandoned(reason: str) -> None:
            # The handler is stuck writing to that client; ending the call from beside it
            # sends the status at once (cancelling the handler's task would not).
            async def abort() -> None:
                with contextlib.suppress(Exception):  # any failure: the call ended already
                    await context.abort(grpc.StatusCode.CANCELLED, reason)

            task = asyncio.get_running_loop().create_task(abort())
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

        return Backpressure(
            limit,
            stalled=lambda: self.core.park(rid),
            reading=lambda: self.core.unpark(rid),
            abandoned=abandoned,
        )

    def _stopper(self, req: GenerationRequest) -> Callable[[], None]:
        """Drops a row whose text hit a stop string (its checkpoint goes with it)."""

        def stop() -> None:
            self.core.cancel(req.request_id, keep_checkpoint=False, stopped=True)

        return stop

    @unary
    async def Tokenize(
        self, request: engine_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.TokenizeResponse:
        ids = await asyncio.to_thread(wire.prompt_from_pb, request, self.loaded)
        return engine_pb2.TokenizeResponse(token_ids=ids)

    @unary
    async def Detokenize(
        self, request: engine_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.DetokenizeResponse:
        ids = wire.detokenize_ids(request, self.loaded)
        return engine_pb2.DetokenizeResponse(text=self.loaded.tokenizer.decode(ids))

    @unary
    async def ModelInfo(
        self, request: engine_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ModelInfoResponse:
        return wire_out.model_info_to_pb(self.policy)

    @unary
    async def Cancel(
        self, request: engine_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.CancelResponse:
        if not await self.core.cancel_known(scoped_id(_owner(), request.request_id)):
            raise NotFound(f"no running or queued request {request.request_id!r}")
        return engine_pb2.CancelResponse()

    @unary
    async def Stats(
        self, request: engine_pb2.EngineStatsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineStatsResponse:
        answer = await self.core.stats()
        reply = wire_out.stats_to_pb(answer.engine, answer.checkpoints, self.policy.has_store)
        if self.access is not None:
            reply.auth_failures = self.access.authenticator.failures_total
        return reply

    @unary
    async def Flush(
        self, request: engine_pb2.EngineFlushRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineFlushResponse:
        return wire_out.flush_to_pb(await self.core.flush())


def _log_request(
    req: GenerationRequest,
    last: ResponseChunk | None,
    arrival: float,
    with_prompt: bool,
) -> None:
    """One line per request that reached the core: who, how much, how fast, how it ended.
    The prompt's token ids only with --log-prompts; never text."""
    usage = last.usage if last is not None else None
    fields: dict[str, Any] = {
        "request_id": req.shown_id,
        "namespace": req.namespace,
        "prompt_tokens": len(req.prompt),
        # A last chunk with its finish reason was sent: finished, even if the client closed
        # the call before this handler resumed. Without one the client left first.
        "finish": (last.finish_reason if last is not None else "") or "client_gone",
        "seconds": round(time.monotonic() - arrival, 4),
    }
    if usage is not None:
        fields.update(
            cached_tokens=usage.cached_prompt_tokens,
            generated_tokens=usage.generated_tokens,
            ttft_s=round(usage.ttft_seconds, 4),
        )
    if req.resume:
        fields["resumed_from"] = req.tokens_held
    if req.checkpoint_interval:
        fields["checkpoint_interval"] = req.checkpoint_interval
    if with_prompt:
        fields["prompt_token_ids"] = list(req.prompt)
    requests_log.info("request", extra={"fields": fields})
