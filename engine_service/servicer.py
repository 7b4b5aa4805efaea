"""The gRPC face of the engine (grpc.aio): requests in, scheduler calls, streams out.

Text work (tokenizing, chat templates, streaming detokenization, stop strings) happens
here, per request, so the MLX thread only moves token ids.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from engine_service import blas
from engine_service.attachments import DRAFT_SCHEMA
from engine_service.checkpoints import CheckpointManager, PrefixPlan, ResumePlan
from engine_service.errors import EngineError, InvalidRequest, NotFound
from engine_service.events import Event, Finished, Sink, Started, Token
from engine_service.model import LoadedModel
from engine_service.prefix_cache import BLOCK_SIZE
from engine_service.quantized_kv import PLAIN_KV, KVCodec, request_layout
from engine_service.requests import (
    DraftSupport,
    GenerationRequest,
    prompt_tokens,
    request_from_pb,
)
from engine_service.scheduler import Deliver, Scheduler
from engine_service.text import TextStream
from tandem_wire.pb import engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

_FINISH = {
    "length": engine_pb2.FINISH_REASON_LENGTH,
    "stop": engine_pb2.FINISH_REASON_STOP,
    "cancelled": engine_pb2.FINISH_REASON_CANCELLED,
    "error": engine_pb2.FINISH_REASON_ERROR,
}


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, name: str) -> None:
    if isinstance(exc, EngineError):
        await context.abort(exc.code, str(exc))
    log.exception("%s failed", name)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}: {exc}")


def rpc_errors(method: F) -> F:
    """Maps engine errors to status codes; anything unknown is logged and becomes INTERNAL."""

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await _abort(context, exc, method.__name__)

    return unary  # type: ignore[return-value]


async def _inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class _DeadlineExceeded(Exception):
    """The engine dropped the request because the client's deadline passed."""


class RequestStream:
    """A request's events, handed over on the event loop, read by its handler."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[list[Event]] = asyncio.Queue()

    def push(self, events: list[Event]) -> None:  # on the event loop (see loop_deliver)
        self._queue.put_nowait(events)

    async def next(self) -> list[Event]:
        """Waits for events, then takes everything already queued: a reader that fell
        behind catches up in one message instead of one per token."""
        events = await self._queue.get()
        while not self._queue.empty():
            events = events + self._queue.get_nowait()
        return events


def loop_deliver(loop: asyncio.AbstractEventLoop) -> Deliver:
    """The scheduler's delivery: one hop into the event loop per engine step."""

    def fan_out(outbox: list[tuple[Sink, list[Event]]]) -> None:
        for sink, events in outbox:
            sink(events)

    def deliver(outbox: list[tuple[Sink, list[Event]]]) -> None:
        loop.call_soon_threadsafe(fan_out, outbox)

    return deliver


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(
        self,
        loaded: LoadedModel,
        scheduler: Scheduler,
        context: int,
        default_max_tokens: int,
        checkpoints: CheckpointManager | None = None,
        default_checkpoint_interval: int = 0,
        default_kv: KVCodec = PLAIN_KV,
        drafts: DraftSupport | None = None,
    ) -> None:
        self.default_kv = default_kv
        self.drafts = drafts or DraftSupport()
        self.checkpoints = checkpoints
        self.default_checkpoint_interval = default_checkpoint_interval
        self.loaded = loaded
        self.scheduler = scheduler
        self.context = context
        self.default_max_tokens = default_max_tokens

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        arrival = time.monotonic()
        try:
            remaining = context.time_remaining()
            deadline = arrival + remaining if remaining is not None else None
            # Text and chat prompts run the tokenizer / chat template: off the event loop.
            # Token-id prompts only need checks: inline, saving two thread hand-offs.
            convert = asyncio.to_thread if (request.text or request.messages) else _inline
            req = await convert(
                request_from_pb,
                request,
                self.loaded,
                self.context,
                self.default_max_tokens,
                deadline,
                self.checkpoints is not None and self.checkpoints.has_store,
                self.default_checkpoint_interval,
                self.default_kv,
                self.drafts,
            )
            plan = await self._plan(req)
            replay = [*plan.generated, plan.pending] if isinstance(plan, ResumePlan) else []
            stream = RequestStream()
            if not self._complete_after_replay(req, replay):
                self.scheduler.submit(req, stream.push, plan)
        except EngineError as exc:
            await context.abort(exc.code, str(exc))
        except Exception as exc:
            log.exception("Generate failed before admission")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc}")
        finished = False
        try:
            async for message in self._responses(req, stream, arrival, replay):
                yield message
            finished = True
        except _DeadlineExceeded:
            finished = True
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        finally:
            if not finished:  # the client went away or the deadline passed: free the row,
                # keeping its checkpoint so the client can resume
                self.scheduler.cancel(req.request_id, keep_checkpoint=True)

    async def _plan(self, req: GenerationRequest) -> PrefixPlan | ResumePlan | None:
        """The checkpoint a request starts from: its own (resume) or a cached prefix."""
        ckpt = self.checkpoints
        if ckpt is None:
            return None
        if req.resume:
            key = ckpt.generation_key(
                req.namespace, req.prompt, req.sampling, req.request_id, req.layout
            )
            # A speculative generation resumes with its draft model's cache when the
            # checkpoint carries one made by this engine's draft model.
            companions = (
                {DRAFT_SCHEMA: {"draft_model": self.drafts.model_id}} if req.num_draft else None
            )
            return await asyncio.to_thread(
                ckpt.load_generation, key, req.namespace, req.prompt, req.layout, companions
            )
        if len(req.prompt) > BLOCK_SIZE:
            return await asyncio.to_thread(ckpt.find_prefix, req.prompt, req.namespace, req.layout)
        return None

    def _complete_after_replay(self, req: GenerationRequest, replay: list[int]) -> bool:
        """A resumed generation whose checkpoint already reached its end needs no batch row."""
        if not replay:
            return False
        return replay[-1] in self.stop_ids(req) or len(replay) >= req.max_tokens

    async def _responses(
        self,
        req: GenerationRequest,
        stream: RequestStream,
        arrival: float,
        replay: list[int],
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        text = TextStream(self.loaded.tokenizer, req.sampling.stop, req.prompt)
        stop_ids = self.stop_ids(req)
        usage = engine_pb2.Usage(prompt_tokens=len(req.prompt))
        first_token_at = last_token_at = 0.0
        generated = 0
        if replay:
            # Resume: tokens from the checkpoint, sent from the first one the client lacks.
            usage.cached_prompt_tokens = len(req.prompt)
            first_token_at = last_token_at = time.monotonic()
            replayed = engine_pb2.GenerateResponse()
            for index, token in enumerate(replay):
                delta = "" if token in stop_ids else text.add(token)
                if index >= req.tokens_held:
                    replayed.token_ids.append(token)
                    replayed.text += delta
            generated = len(replay)
            if self._complete_after_replay(req, replay):
                stop = replay[-1] in stop_ids
                replayed.finish_reason = (
                    engine_pb2.FINISH_REASON_STOP if stop else engine_pb2.FINISH_REASON_LENGTH
                )
                replayed.text += "" if stop else text.finish()
                replayed.request_id = req.request_id
                self._finish_usage(usage, generated, arrival, first_token_at, last_token_at)
                replayed.usage.CopyFrom(usage)
                yield replayed
                return
            if replayed.token_ids:
                yield replayed
        while True:
            message: engine_pb2.GenerateResponse | None = None
            for event in await stream.next():
                if isinstance(event, Started):
                    usage.cached_prompt_tokens = event.cached_prompt_tokens
                elif isinstance(event, Token):
                    last_token_at = time.monotonic()
                    if not generated:
                        first_token_at = last_token_at
                    generated += 1
                    # A resumed client already holds the first tokens_held tokens.
                    send = generated > req.tokens_held
                    message = message or engine_pb2.GenerateResponse()
                    if send:
                        message.token_ids.append(event.token_id)
                        if event.logprob is not None:
                            message.logprobs.append(self._logprob(event))
                    if event.token_id in stop_ids:
                        continue  # ends the generation; its text is not part of the output
                    delta = text.add(event.token_id)
                    if send:
                        message.text += delta
                    if text.stopped_by:
                        # A stop string: the text is cut exactly; tell the loop to drop the row.
                        self.scheduler.cancel(req.request_id, keep_checkpoint=False)
                        message.finish_reason = engine_pb2.FINISH_REASON_STOP
                        message.matched_stop = text.stopped_by
                        message.request_id = req.request_id
                        self._finish_usage(usage, generated, arrival, first_token_at, last_token_at)
                        message.usage.CopyFrom(usage)
                        yield message
                        return
                elif isinstance(event, Finished):
                    if event.reason == "deadline":
                        raise _DeadlineExceeded
                    usage.draft_tokens = event.drafted
                    usage.accepted_draft_tokens = event.accepted
                    final = message or engine_pb2.GenerateResponse()
                    final.finish_reason = _FINISH[event.reason]
                    final.error = event.error
                    final.request_id = req.request_id
                    if event.reason in ("length", "stop"):
                        final.text += text.finish()
                    if event.stop_token is not None:
                        final.matched_stop = self.loaded.tokenizer.decode([event.stop_token])
                    self._finish_usage(usage, generated, arrival, first_token_at, last_token_at)
                    final.usage.CopyFrom(usage)
                    yield final
                    return
            if message is not None and (message.token_ids or message.text):
                yield message

    def stop_ids(self, req: GenerationRequest) -> set[int]:
        ids = set(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            ids.update(self.loaded.eos_token_ids)
        return ids

    def _logprob(self, event: Token) -> engine_pb2.TokenLogprob:
        decode = self.loaded.tokenizer.decode
        return engine_pb2.TokenLogprob(
            token_id=event.token_id,
            logprob=event.logprob or 0.0,
            top=[
                engine_pb2.TopLogprob(token_id=t, logprob=v, text=decode([t]))
                for t, v in (event.top or [])
            ],
        )

    @staticmethod
    def _finish_usage(
        usage: engine_pb2.Usage, generated: int, arrival: float, first: float, last: float
    ) -> None:
        usage.generated_tokens = generated
        if generated:
            usage.ttft_seconds = first - arrival
        if generated > 1 and last > first:
            usage.decode_tokens_per_second = (generated - 1) / (last - first)

    @rpc_errors
    async def Tokenize(
        self, request: engine_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.TokenizeResponse:
        ids = await asyncio.to_thread(prompt_tokens, request, self.loaded)
        return engine_pb2.TokenizeResponse(token_ids=ids)

    @rpc_errors
    async def Detokenize(
        self, request: engine_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.DetokenizeResponse:
        bad = [t for t in request.token_ids if not 0 <= t < self.loaded.vocab_size]
        if bad:
            raise InvalidRequest(f"unknown token ids {bad[:5]}")
        text = self.loaded.tokenizer.decode(list(request.token_ids))
        return engine_pb2.DetokenizeResponse(text=text)

    @rpc_errors
    async def ModelInfo(
        self, request: engine_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ModelInfoResponse:
        m = self.loaded
        return engine_pb2.ModelInfoResponse(
            model_id=m.model_id,
            name=m.name,
            digest=m.digest,
            context_length=self.context,
            vocab_size=m.vocab_size,
            layout=request_layout(m.layout, self.default_kv),
            kv_bits=self.default_kv.bits,
            kv_group_size=self.default_kv.group_size,
            quantized_kv_start=self.default_kv.start,
            draft_model_id=self.drafts.model_id,
            num_draft_tokens=self.drafts.default,
            model_type=str(m.config.get("model_type", "")),
            dtype=m.dtype,
            eos_token_ids=m.eos_token_ids,
            blas=blas.in_use(),
        )

    @rpc_errors
    async def Cancel(
        self, request: engine_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.CancelResponse:
        if not self.scheduler.cancel(request.request_id):
            raise NotFound(f"no running or queued request {request.request_id!r}")
        return engine_pb2.CancelResponse()

    @rpc_errors
    async def Stats(
        self, request: engine_pb2.EngineStatsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineStatsResponse:
        s = self.scheduler.stats()
        reply = engine_pb2.EngineStatsResponse(
            running=s.running,
            queued=s.queued,
            requests_total=s.requests_total,
            generated_tokens_total=s.generated_tokens_total,
            prompt_tokens_total=s.prompt_tokens_total,
            decode_tokens_per_second=s.decode_tokens_per_second,
            batch_size=s.batch_size,
            max_batch_size_seen=s.max_batch_size_seen,
            mean_batch_size=s.mean_batch_size,
            cancelled_total=s.cancelled_total,
            rejected_total=s.rejected_total,
            steps_total=s.steps_total,
        )
        if self.checkpoints is not None:
            c = self.checkpoints.snapshot()
            reply.checkpoints.CopyFrom(
                engine_pb2.CheckpointStats(
                    prefix_hits_local=c.local_hits,
                    prefix_hits_store=c.store_hits,
                    prefix_misses=c.misses,
                    restore_failures=c.restore_failures,
                    restored_bytes=c.restored_bytes,
                    restore_seconds=c.restore_seconds,
                    prefill_seconds=c.prefill_seconds,
                    saved=c.saved,
                    saved_bytes=c.saved_bytes,
                    dropped=c.dropped,
                    failed=c.failed,
                    queued_bytes=c.queued_bytes,
                    resumes=c.resumes,
                    store_up=c.store_up,
                    store_configured=self.checkpoints.has_store,
                )
            )
        return reply

    @rpc_errors
    async def Flush(
        self, request: engine_pb2.EngineFlushRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineFlushResponse:
        if self.checkpoints is None:
            return engine_pb2.EngineFlushResponse(durable=False)
        durable, counts = await asyncio.to_thread(self.checkpoints.flush)
        return engine_pb2.EngineFlushResponse(
            durable=durable,
            flushed=counts["flushed"],
            missing=counts["missing"],
            failed=counts["failed"],
        )
