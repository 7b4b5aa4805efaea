"""From engine events to what a client receives: text, replayed tokens, logprobs, usage.

Runs on the event loop, per request. The MLX loop sends token ids (protocol/events.py); here they
are
detokenized with exact stop strings (front/text.py), a resumed generation's held tokens are
replayed from its checkpoint, and the last chunk carries the usage. Chunks are domain values;
front/wire.py turns them into GenerateResponse messages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engine_service.errors import (
    Abandoned,
    DeadlineExceeded,
    InvalidRequest,
    ModelFailed,
    Unavailable,
    error_named,
)
from engine_service.front.metrics import RequestMetrics
from engine_service.front.reasoning import ReasoningSplit
from engine_service.front.text import TextStream
from engine_service.front.tool_calls import ToolCallDelta, ToolCallSplit
from engine_service.protocol.events import (
    Event,
    Finished,
    PrefixMissReason,
    PrefixSource,
    Started,
    Token,
)
from engine_service.protocol.requests import GenerationRequest

ResponseFinish = Literal["length", "stop", "cancelled", "error"]


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    text: str


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[TopLogprob]
    text: str = ""  # the token decoded alone


@dataclass
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_seconds: float = 0.0
    decode_tokens_per_second: float = 0.0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    constraint_incomplete: bool = False
    prefix_miss_reason: PrefixMissReason = ""  # why no cached prefix was reused
    prefix_source: PrefixSource = ""  # where the reused prefix came from


@dataclass
class ResponseChunk:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning_text: str = ""  # a reasoning model's thinking (front/reasoning.py)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # front/tool_calls.py
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: ResponseFinish | None = None
    matched_stop: str = ""
    error: str = ""
    request_id: str = ""
    usage: Usage | None = None

    @property
    def empty(self) -> bool:
        return not (self.token_ids or self.text or self.reasoning_text or self.tool_calls)


@dataclass(frozen=True)
class Backpressure:
    """What a stream tells the engine loop about its reader (loop/preemption.py)."""

    unread_limit: int  # tokens waiting here before `stalled` is called
    stalled: Callable[[], None]  # the client's window is full and it fell that far behind
    reading: Callable[[], None]  # it read again
    abandoned: Callable[[str], None]  # the loop gave up on it (idle timeout): end the call


class RequestStream:
    """A request's events, handed over on the event loop, read by its handler.

    Tokens wait here only when the handler cannot hand them to gRPC: the client's HTTP/2
    window is full, i.e. the client stopped reading (a gRPC client's library buffers up
    to its window, 64 KiB or more, before that shows). Their count is the backlog.
    """

    def __init__(self, backpressure: Backpressure | None = None) -> None:
        self._queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        self._backpressure = backpressure
        self._unread = 0
        self._stalled = False

    def push(self, events: list[Event]) -> None:  # on the event loop (front/core_link.py)
        self._queue.put_nowait(events)
        bp = self._backpressure
        if bp is None:
            return
        for event in events:
            if isinstance(event, Finished) and event.reason == "idle":
                bp.abandoned(event.error)
                return
        self._unread += sum(isinstance(e, Token) for e in events)
        if not self._stalled and self._unread >= bp.unread_limit:
            self._stalled = True
            bp.stalled()

    async def next(self) -> list[Event]:
        """Waits for events, then takes everything already queued: a reader that fell
        behind catches up in one message instead of one per token."""
        events = await self._queue.get()
        while not self._queue.empty():
            events = events + self._queue.get_nowait()
        self._unread = 0
        if self._stalled and self._backpressure is not None:
            self._stalled = False
            self._backpressure.reading()
        return events


class ResponseBuilder:
    """The text and usage of one generation as its tokens arrive."""

    def __init__(
        self,
        req: GenerationRequest,
        tokenizer: Any,
        arrival: float,
        metrics: RequestMetrics | None = None,
        reasoning: ReasoningSplit | None = None,
        tools: ToolCallSplit | None = None,
    ) -> None:
        self.req = req
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.text = TextStream(tokenizer, req.sampling.stop, req.prompt)
        self.reasoning = reasoning
        self.tools = tools
        self.usage = Usage(prompt_tokens=len(req.prompt))
        self.arrival = arrival
        self.first_token_at = self.last_token_at = 0.0

    @property
    def generated(self) -> int:
        return self.usage.generated_tokens

    def add(self, chunk: ResponseChunk, event: Token) -> None:
        """One generated token into the chunk (a resumed client already holds the first
        tokens_held: counted, not sent)."""
        now = time.monotonic()
        if self.metrics is not None and self.generated > self.req.tokens_held:
            self.metrics.itl.observe(now - self.last_token_at)
        self.last_token_at = now
        if not self.generated:
            self.first_token_at = self.last_token_at
        self.usage.generated_tokens += 1
        send = self.generated > self.req.tokens_held
        if send:
            chunk.token_ids.append(event.token_id)
            if event.logprob is not None:
                chunk.logprobs.append(self._logprob(event))
        if event.token_id in self.req.stop_ids:
            return  # ends the generation; its text is not part of the output
        # The splits see every piece, sent or held by the client, so their state is the
        # same on an engine that resumes the generation; what the client holds is dropped.
        self._put(chunk if send else ResponseChunk(), self.text.add(event.token_id))

    def _put(self, chunk: ResponseChunk, text: str, final: bool = False) -> None:
        if self.reasoning is None:
            content = text
        else:
            parts = [self.reasoning.add(text)] + ([self.reasoning.finish()] if final else [])
            content = ""
            for part in parts:
                chunk.reasoning_text += part.reasoning
                content += part.content
        if self.tools is None:
            chunk.text += content
            return
        for split in [self.tools.add(content)] + ([self.tools.finish()] if final else []):
            chunk.text += split.content
            chunk.tool_calls.extend(split.calls)

    def finish(
        self, chunk: ResponseChunk, reason: ResponseFinish, stop_token: int | None = None
    ) -> ResponseChunk:
        held = self.req.tokens_held
        if reason in ("length", "stop") and self.generated < held:
            # The generation ended short of what the client says it holds: that count is
            # wrong (nothing was sent yet), and an OK would leave it with a silent gap.
            raise InvalidRequest(
                f"tokens_held {held} exceeds the {self.generated} tokens this generation "
                "emits; resume with the count of tokens received"
            )
        chunk.finish_reason = reason
        chunk.request_id = self.req.shown_id
        if self.text.stopped_by:
            chunk.matched_stop = self.text.stopped_by
            self._put(chunk, "", final=True)  # what the splits still hold
        elif reason in ("length", "stop"):
            self._put(chunk, self.text.finish(), final=True)
        if stop_token is not None:
            chunk.matched_stop = self.tokenizer.decode([stop_token])
        u = self.usage
        if u.generated_tokens:
            u.ttft_seconds = self.first_token_at - self.arrival
        if u.generated_tokens > 1 and self.last_token_at > self.first_token_at:
            u.decode_tokens_per_second = (u.generated_tokens - 1) / (
                self.last_token_at - self.first_token_at
            )
        chunk.usage = u
        if self.metrics is not None:
            self.metrics.finish(
                reason,
                u.prompt_tokens,
                u.generated_tokens,
                u.ttft_seconds,
                time.monotonic() - self.arrival,
            )
        return chunk

    def _logprob(self, event: Token) -> TokenLogprob:
        decode = self.tokenizer.decode
        top = [TopLogprob(t, v, decode([t])) for t, v in (event.top or [])]
        return TokenLogprob(event.token_id, event.logprob or 0.0, top, decode([event.token_id]))


async def respond(
    req: GenerationRequest,
    tokenizer: Any,
    events: RequestStream,
    arrival: float,
    replay: list[int],
    stop_row: Callable[[], None],
    metrics: RequestMetrics | None = None,
    reasoning: ReasoningSplit | None = None,
    tools: ToolCallSplit | None = None,
    replay_tokens: Sequence[Token] = (),
) -> AsyncIterator[ResponseChunk]:
    """The chunks of one generation: replayed tokens first (resume), then the engine's.
    replay_tokens: the events of the replay's last tokens, with their logprobs (asked for).

    stop_row: called when a stop string ends the text, so the loop drops the row.
    Raises DeadlineExceeded when the engine dropped the request at its deadline, Unavailable
    when the engine core exited under it, and the engine's error (ModelFailed, Corrupt...)
    when the row failed there.
    """
    out = ResponseBuilder(req, tokenizer, arrival, metrics, reasoning, tools)
    if replay:
        out.usage.cached_prompt_tokens = len(req.prompt)
        chunk = ResponseChunk()
        # The tokens the client does not hold come with their logprobs when it asked.
        with_logprobs = len(replay) - len(replay_tokens)
        for i, token in enumerate(replay):
            out.add(chunk, replay_tokens[i - with_logprobs] if i >= with_logprobs else Token(token))
        if req.finished_by(replay):
            stop = replay[-1] in req.stop_ids
            yield out.finish(chunk, "stop" if stop else "length")
            return
        if chunk.token_ids:
            yield chunk
    while True:
        chunk = ResponseChunk()
        for event in await events.next():
            if isinstance(event, Started):
                out.usage.cached_prompt_tokens = event.cached_prompt_tokens
                out.usage.prefix_miss_reason = event.prefix_miss_reason
                out.usage.prefix_source = event.prefix_source
            elif isinstance(event, Token):
                out.add(chunk, event)
                if out.text.stopped_by:
                    # A stop string: the text is cut exactly; the row is dropped.
                    stop_row()
                    yield out.finish(chunk, "stop")
                    return
            elif isinstance(event, Finished):
                if event.reason == "deadline":
                    raise DeadlineExceeded("deadline exceeded")
                if event.reason == "idle":
                    raise Abandoned(event.error)
                if event.reason == "unavailable":
                    raise Unavailable(event.error)
                if event.reason == "error":  # a status, never OK with 0 tokens
                    raise error_named(event.failure or ModelFailed.__name__, event.error)
                out.usage.draft_tokens = event.drafted
                out.usage.accepted_draft_tokens = event.accepted
                out.usage.constraint_incomplete = event.constraint_incomplete
                chunk.error = event.error
                yield out.finish(chunk, event.reason, event.stop_token)
                return
        if not chunk.empty:
            yield chunk
