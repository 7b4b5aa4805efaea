"""One generation through the gateway: the engine chosen, the stream relayed, and when that
engine dies, is unreachable or drains, the same stream continued on another.

The client's one stream carries exactly the tokens of an uninterrupted run:
- the gateway counts the tokens it has sent. A failover asks the next engine to `resume`
  the generation's checkpoint (the store is shared) with `tokens_held` = that count: the
  engine replays from the checkpoint and sends only what follows (docs/checkpoints.md);
- with no checkpoint yet (NOT_FOUND), the request starts again on the next engine with
  `tokens_held` = the count: it is generated again with the same seed and the tokens the
  client holds are not sent twice;
- text is decoded from the whole token sequence on the engine, so the text after the count
  is the text an uninterrupted run sends after it.
Streams run with a checkpoint interval (the gateway's default) on engines with a store, so a
failover resumes at most that many tokens back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

import grpc

from gateway_service.affinity import affinity_key, rendezvous_rank
from gateway_service.backends import Backend, BackendPool
from gateway_service.metrics import GatewayMetrics
from tandem_wire.pb import engine_pb2

log = logging.getLogger("tandem.gateway")

FINISH_UNSET = engine_pb2.FINISH_REASON_UNSPECIFIED
FINISH_CANCELLED = engine_pb2.FINISH_REASON_CANCELLED


class GatewayError(Exception):
    """An answer the gateway gives itself (no engine serves, an unknown model)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def message_too_large(code: grpc.StatusCode, details: str) -> bool:
    """RESOURCE_EXHAUSTED from gRPC's message-size limit (on either side): the request is
    too large, not the engine too busy, so no other engine takes it and no retry helps."""
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in details


@dataclass(frozen=True)
class Caller:
    """Who asked: the metadata forwarded to engines (their bearer token: each engine decides
    tenancy itself) and a scope that keeps callers' request ids and prefixes apart."""

    scope: str = ""
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RelaySettings:
    checkpoint_interval: int = 16
    failover_wait_s: float = 10.0
    max_failovers: int = 8
    affinity_slack: int = 4


@dataclass
class _Running:
    backend: Backend
    cancelled: bool = False  # the client asked (Cancel): an ended stream is not a failure


@dataclass
class _Attempt:
    """How the next engine is asked: the request as sent, a resume, or a restart."""

    resume: bool = False
    tokens_held: int = 0
    full: set[str] = field(default_factory=set)  # engines that answered RESOURCE_EXHAUSTED
    # The lost engine's --deterministic: engines of that mode come first (its checkpoints
    # resume only there, and a restart there repeats the tokens already sent). None: any.
    deterministic: bool | None = None
    # The request asked for it (GenerateRequest.deterministic): engines of that mode only.
    required: bool = False


class _EngineLost(Exception):
    pass


class Relay:
    def __init__(
        self,
        pool: BackendPool,
        settings: RelaySettings,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.requests_total = 0
        self.running: dict[tuple[str, str], _Running] = {}
        self.failovers_total = 0
        self.restarts_total = 0  # failovers that found no checkpoint and generated again

    async def generate(
        self, request: engine_pb2.GenerateRequest, caller: Caller, model: str = ""
    ) -> AsyncGenerator[engine_pb2.GenerateResponse, None]:
        req = engine_pb2.GenerateRequest()
        req.CopyFrom(request)
        req.request_id = req.request_id or f"gw-{uuid.uuid4().hex}"
        # What the client held before this call: the engine skips that many tokens, resume
        # or not, so every later attempt skips them and what this stream sent.
        held = req.tokens_held
        affinity = affinity_key(req, caller.scope)
        attempt = _Attempt(req.resume, req.tokens_held, required=req.deterministic)
        if req.deterministic:
            attempt.deterministic = True
        key = (caller.scope, req.request_id)
        sent, failovers, arrival, first_at = 0, 0, time.monotonic(), 0.0
        lost_at = 0.0  # when the last engine was lost (the failover gap's start)
        self.requests_total += 1
        outcome = ""  # how it ended, once it did: the finish reason or the status
        engines: list[str] = []
        try:
            while True:
                backend = await self._choose(model, affinity, attempt)
                engines.append(backend.address)
                running = self.running[key] = _Running(backend)
                backend.streams += 1
                call = backend.stub.Generate(
                    self._request(req, attempt, backend), metadata=caller.metadata
                )
                try:
                    async for message in call:
                        if message.finish_reason == FINISH_CANCELLED and not running.cancelled:
                            # Cancelled by the engine: failover only if it is going away (a
                            # drain); a Cancel sent to it by some other way ends the stream.
                            if not await self.pool.serving(backend):
                                raise _EngineLost("the engine cancelled the stream (shutting down)")
                        if message.token_ids and (not first_at or lost_at):
                            now = time.monotonic()
                            if self.metrics is not None:
                                if not first_at:
                                    self.metrics.ttft.observe(now - arrival)
                                else:
                                    self.metrics.failover_gap.observe(now - lost_at)
                            first_at, lost_at = first_at or now, 0.0
                        sent += len(message.token_ids)
                        if message.finish_reason != FINISH_UNSET:
                            message.usage.failovers = failovers
                            if failovers and first_at:  # the engine's clock started at its resume
                                message.usage.ttft_seconds = first_at - arrival
                            outcome = engine_pb2.FinishReason.Name(message.finish_reason)
                            yield message
                            return
                        yield message
                    if running.cancelled:
                        outcome = "cancelled"
                        return
                    raise _EngineLost("the stream ended without its last message")
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                    if (
                        code == grpc.StatusCode.RESOURCE_EXHAUSTED
                        and not sent
                        and not failovers
                        and not message_too_large(code, exc.details() or "")
                    ):
                        attempt.full.add(backend.address)  # try an engine with room
                        if len(attempt.full) < len(self.pool.healthy(model)):
                            continue
                        raise
                    if (
                        attempt.resume
                        and failovers
                        and code
                        in (
                            grpc.StatusCode.NOT_FOUND,
                            grpc.StatusCode.FAILED_PRECONDITION,
                        )
                    ):
                        # No checkpoint reached the store (or it ended there): start again.
                        log.info(
                            "request %s: no checkpoint to resume (%s); generating again, %d "
                            "tokens held",
                            req.request_id,
                            code.name,
                            held + sent,
                        )
                        self.restarts_total += 1
                        attempt = replace(
                            attempt, resume=False, tokens_held=held + sent, full=set()
                        )
                        continue
                    if code != grpc.StatusCode.UNAVAILABLE or running.cancelled:
                        raise
                    failure = f"{code.name}: {exc.details()}"
                except _EngineLost as exc:
                    failure = str(exc)
                finally:
                    backend.streams -= 1
                    call.cancel()  # no-op once it ended; the client left otherwise
                    if self.running.get(key) is running:
                        del self.running[key]
                failovers += 1
                self.failovers_total += 1
                lost_at = lost_at or time.monotonic()
                if failovers > self.settings.max_failovers:
                    raise GatewayError(
                        grpc.StatusCode.UNAVAILABLE, f"gave up after {failovers - 1} failovers"
                    )
                self.pool.mark_down(backend, failure)
                log.warning(
                    "request %s: engine %s lost after %d tokens (%s); failing over",
                    req.request_id,
                    backend.address,
                    held + sent,
                    failure,
                )
                checkpointed = backend.has_store and bool(self._interval(req, backend))
                attempt = _Attempt(
                    resume=checkpointed or req.resume,
                    tokens_held=held + sent,
                    deterministic=backend.facts.deterministic if backend.facts else None,
                    required=attempt.required,
                )
        except (GeneratorExit, asyncio.CancelledError):
            # Also raised after the last message, when the HTTP layer closes the generator:
            # only a stream that had not ended is the client's going away.
            outcome = outcome or "client_gone"
            raise
        except grpc.aio.AioRpcError as exc:
            outcome = exc.code().name
            raise
        except GatewayError as exc:
            outcome = exc.code.name
            raise
        finally:
            log_request(
                req.request_id,
                req.namespace or "default",  # as the engine names it
                outcome or "error",
                held + sent,
                failovers,
                engines,
                time.monotonic() - arrival,
            )

    async def cancel(self, request_id: str, caller: Caller) -> engine_pb2.CancelResponse:
        running = self.running.get((caller.scope, request_id))
        if running is None:
            raise GatewayError(grpc.StatusCode.NOT_FOUND, f"no request {request_id!r} running")
        running.cancelled = True
        reply: engine_pb2.CancelResponse = await running.backend.stub.Cancel(
            engine_pb2.CancelRequest(request_id=request_id), metadata=caller.metadata
        )
        return reply

    def _interval(self, req: engine_pb2.GenerateRequest, backend: Backend) -> int:
        if req.checkpoint_interval or not backend.has_store:
            return req.checkpoint_interval
        return self.settings.checkpoint_interval

    def _request(
        self, req: engine_pb2.GenerateRequest, attempt: _Attempt, backend: Backend
    ) -> engine_pb2.GenerateRequest:
        out = engine_pb2.GenerateRequest()
        out.CopyFrom(req)
        out.checkpoint_interval = self._interval(req, backend)
        out.resume = attempt.resume
        out.tokens_held = attempt.tokens_held
        return out

    async def _choose(self, model: str, affinity: bytes | None, attempt: _Attempt) -> Backend:
        """The engine for the next attempt: the first of the prefix's ranking (the same in
        every gateway) that is no busier than the least loaded plus the slack, among those of
        the lost engine's mode when any is up (of the deterministic mode only, for a request
        that asks for it; of that mode only, too, for a resume, which an engine of the other
        mode refuses: one of them found up first, before its peers of the mode, took such a
        resume only to refuse it); waits for one when none is healthy."""
        deadline = time.monotonic() + self.settings.failover_wait_s
        while True:
            candidates = [b for b in self.pool.healthy(model) if b.address not in attempt.full]
            same_mode = [b for b in candidates if _deterministic(b) == attempt.deterministic]
            only_same = attempt.required or attempt.resume
            if attempt.deterministic is not None and (same_mode or only_same):
                candidates = same_mode
            if candidates:
                break
            known = [f for f in self.pool.known_models() if f.serves(model)]
            if model and not known:
                raise GatewayError(grpc.StatusCode.NOT_FOUND, f"no engine serves model {model!r}")
            if attempt.required and known and not any(f.deterministic for f in known):
                raise GatewayError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "a deterministic request needs an engine started with --deterministic; "
                    "none serves this model",
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, "no engine is serving")
            await self.pool.wait_for_change(min(left, self.pool.poll_interval_s))
        least = min(candidates, key=lambda b: (b.load, b.routed))
        by_address = {b.address: b for b in candidates}
        for address in rendezvous_rank(affinity, list(by_address)):
            ranked = by_address[address]
            if ranked.load <= least.load + self.settings.affinity_slack:
                least = ranked  # the first of the ranking within the slack (least is)
                break
        least.routed += 1
        return least


def _deterministic(backend: Backend) -> bool:
    return backend.facts is not None and backend.facts.deterministic


requests_log = logging.getLogger("tandem.gateway.requests")


def log_request(
    request_id: str,
    namespace: str,
    outcome: str,
    tokens: int,
    failovers: int,
    engines: list[str],
    seconds: float,
) -> None:
    """One line per generation relayed: where it ran, how it ended. Never the prompt."""
    fields = {
        "request_id": request_id,
        "namespace": namespace,
        "finish": outcome,
        "tokens_sent": tokens,
        "failovers": failovers,
        "engines": ",".join(engines),
        "seconds": round(seconds, 4),
    }
    requests_log.info("request", extra={"fields": fields})
