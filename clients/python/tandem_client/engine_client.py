"""EngineClient: streaming generation and the engine's other RPCs, with typed results."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from tandem_client.channel import GrpcClient
from tandem_client.errors import Unavailable, from_rpc_error
from tandem_client.failover import (
    FAILOVER_WAIT_S,
    AddressedStubs,
    Move,
    StreamAttempts,
    split_addresses,
)
from tandem_client.tools import ToolCall, chat_message, merge_tool_calls, put_tools, tools_pb
from tandem_wire.pb import engine_pb2

T = TypeVar("T")
Prompt = str | Sequence[int] | Sequence[dict[str, str]]
_FINISH_NAMES = {
    engine_pb2.FINISH_REASON_UNSPECIFIED: "",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_CANCELLED: "cancelled",
    engine_pb2.FINISH_REASON_ERROR: "error",
}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    ttft_seconds: float
    decode_tokens_per_second: float
    draft_tokens: int = 0  # speculative decoding: proposed, and kept by the target
    accepted_draft_tokens: int = 0
    failovers: int = 0  # through a gateway: times the stream moved to another engine
    constraint_incomplete: bool = False  # a constrained output cut short by max_tokens
    prefix_miss_reason: str = ""  # why the prompt reused no cached prefix ("" if it did)
    prefix_source: str = ""  # where a reused prefix came from ("local", "store: region", ...)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float, str]]
    text: str = ""  # the token decoded alone


@dataclass(frozen=True)
class GenerationChunk:
    """One streamed message: new tokens and the text they complete; the last one also
    carries finish_reason and usage."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    usage: Usage | None = None
    request_id: str = ""
    error: str = ""
    matched_stop: str = ""
    reasoning_text: str = ""  # a reasoning model's thinking (chat requests)
    # With tools: pieces of the calls (index; id and name first, then arguments in pieces).
    tool_calls: list[engine_pb2.ToolCallDelta] = field(default_factory=list)

    @classmethod
    def from_pb(cls, m: engine_pb2.GenerateResponse) -> GenerationChunk:
        usage = None
        if m.HasField("usage"):
            u = m.usage
            usage = Usage(
                u.prompt_tokens,
                u.cached_prompt_tokens,
                u.generated_tokens,
                u.ttft_seconds,
                u.decode_tokens_per_second,
                u.draft_tokens,
                u.accepted_draft_tokens,
                u.failovers,
                u.constraint_incomplete,
                u.prefix_miss_reason,
                u.prefix_source,
            )
        return cls(
            token_ids=list(m.token_ids),
            text=m.text,
            logprobs=[
                TokenLogprob(
                    lp.token_id,
                    lp.logprob,
                    [(t.token_id, t.logprob, t.text) for t in lp.top],
                    lp.text,
                )
                for lp in m.logprobs
            ],
            finish_reason=_FINISH_NAMES.get(m.finish_reason, ""),
            usage=usage,
            request_id=m.request_id,
            error=m.error,
            matched_stop=m.matched_stop,
            reasoning_text=m.reasoning_text,
            tool_calls=list(m.tool_calls),
        )


@dataclass
class Generation:
    """A whole generation, collected from its stream."""

    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage | None
    chunks: list[GenerationChunk]
    reasoning_text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # whole, merged from the pieces

    @classmethod
    def collect(cls, chunks: Iterator[GenerationChunk]) -> Generation:
        got = list(chunks)
        last = got[-1] if got else GenerationChunk([], "")
        return cls(
            [t for c in got for t in c.token_ids],
            "".join(c.text for c in got),
            last.finish_reason,
            last.usage,
            got,
            "".join(c.reasoning_text for c in got),
            merge_tool_calls(d for c in got for d in c.tool_calls),
        )


def sampling_pb(
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 0.0,
    repetition_context_size: int = 0,
    seed: int = 0,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    logprobs: int | None = None,
    ignore_eos: bool = False,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
) -> engine_pb2.SamplingParams:
    params = engine_pb2.SamplingParams(
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logit_bias=dict(logit_bias or {}),
        temperature=temperature,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        repetition_context_size=repetition_context_size,
        seed=seed,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
    )
    if top_p is not None:
        params.top_p = top_p
    if logprobs is not None:
        params.logprobs = logprobs
    return params


def _scheme_pb(name: str, field: str) -> engine_pb2.KVScheme.ValueType:
    schemes = {"affine": engine_pb2.KV_SCHEME_AFFINE, "turboquant": engine_pb2.KV_SCHEME_TURBOQUANT}
    if name not in schemes:
        raise ValueError(f"{field} must be affine or turboquant, got {name!r}")
    return schemes[name]


def generate_request(
    prompt: Prompt,
    *,
    max_tokens: int | None = None,
    request_id: str = "",
    namespace: str = "",
    checkpoint_interval: int = 0,
    resume: bool = False,
    tokens_held: int = 0,
    kv_bits: int | None = None,
    kv_group_size: int = 0,
    quantized_kv_start: int | None = None,
    kv_scheme: str | None = None,
    kv_value_bits: int = 0,
    num_draft_tokens: int | None = None,
    prefix_record_bits: int = 0,
    prefix_record_scheme: str | None = None,
    deterministic: bool = False,
    json_schema: str | dict[str, Any] | None = None,
    regex: str | None = None,
    lark: str | None = None,
    gbnf: str | None = None,
    choice: Sequence[str] | None = None,
    json_object: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    **sampling: Any,
) -> engine_pb2.GenerateRequest:
    """A GenerateRequest from text, token ids or chat messages (dicts of role/content).

    kv_bits: None = the engine's default KV codec, 0 = plain, 4 or 8 = quantized (see
    quantized_kv_start and kv_group_size); with kv_scheme "turboquant" (None: the engine's
    scheme, or "affine"), 2-4 bits for keys and kv_value_bits (0: kv_bits) for values.
    num_draft_tokens: None = the engine's default, 0 = no speculative decoding, k = k draft
    tokens per round (needs --draft-model).
    prefix_record_bits: 8 or 4 keeps the prompt's prefix record in the store as KV codes of
    that many bits (a quarter to a half of the bytes, near the exact prefix, not equal);
    0 = exact. prefix_record_scheme "turboquant" keeps TurboQuant codes instead (4, 3 or 2
    bits; None or "affine": affine codes).
    deterministic: batch-invariant logits (docs/determinism.md): only an engine started with
    --deterministic serves it (another answers FAILED_PRECONDITION; a gateway routes it to
    one).
    Structured output, one at most: json_schema (a dict or its JSON text), regex, lark,
    gbnf, choice (the output is one of these strings) or json_object.
    Tools (chat messages only): see tandem_client/tools.py's put_tools.
    """
    req = engine_pb2.GenerateRequest(
        request_id=request_id,
        namespace=namespace,
        checkpoint_interval=checkpoint_interval,
        resume=resume,
        tokens_held=tokens_held,
        sampling=sampling_pb(**sampling),
        prefix_record_bits=prefix_record_bits,
        deterministic=deterministic,
    )
    if prefix_record_scheme is not None:
        req.prefix_record_scheme = _scheme_pb(prefix_record_scheme, "prefix_record_scheme")
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if kv_bits is not None:
        req.kv_bits = kv_bits
    req.kv_group_size = kv_group_size
    if quantized_kv_start is not None:
        req.quantized_kv_start = quantized_kv_start
    if kv_scheme is not None:
        req.kv_scheme = _scheme_pb(kv_scheme, "kv_scheme")
    req.kv_value_bits = kv_value_bits
    if num_draft_tokens is not None:
        req.num_draft_tokens = num_draft_tokens
    constraints = {
        "json_schema": json_schema,
        "regex": regex,
        "lark": lark,
        "gbnf": gbnf,
        "choice": choice,
        "json_object": json_object or None,
    }
    given = {k: v for k, v in constraints.items() if v is not None}
    if len(given) > 1:
        raise ValueError(f"one constraint at most, got {sorted(given)}")
    for kind, value in given.items():
        if kind == "choice":
            req.constraint.choice.options.extend(value)  # type: ignore[arg-type]
        elif kind == "json_object":
            req.constraint.json_object = True
        else:
            text = json.dumps(value) if isinstance(value, dict) else value
            setattr(req.constraint, kind, text)
    put_tools(req, tools, tool_choice, parallel_tool_calls)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        messages: Any = prompt
        req.messages.extend(chat_message(m) for m in messages)
    else:
        req.token_ids.extend(prompt)  # type: ignore[arg-type]
    return req


class EngineClient(GrpcClient, AddressedStubs):
    """Synchronous client of `tandem.v1.Engine`: an engine, or gateways in front of engines.

    address: one HOST:PORT, or several ("a,b" or a list) of one service, tried in order: a
    stream whose server dies goes on through the next with the request id and the tokens
    already given (tandem_client/failover.py), and other calls move on as well.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        timeout: float | None = 300.0,
        credentials: grpc.ChannelCredentials | None = None,
        token: str = "",
        failover_wait_s: float = FAILOVER_WAIT_S,
    ) -> None:
        self.addresses = split_addresses(address)
        self.failover_wait_s = failover_wait_s
        super().__init__(self.addresses[0], timeout, credentials, token=token)
        self._init_stubs()

    def request(self, prompt: Prompt, **options: Any) -> engine_pb2.GenerateRequest:
        """A GenerateRequest from text, token ids or chat messages (dicts of role/content)."""
        return generate_request(prompt, **options)

    def stream(
        self, prompt: str | Sequence[int] | Sequence[dict[str, str]], **options: Any
    ) -> Generator[GenerationChunk, None, None]:
        """Streams a generation as it is produced; close() it to cancel the call."""
        return self.stream_request(self.request(prompt, **options))

    def stream_request(
        self, request: engine_pb2.GenerateRequest, timeout: float | None = None
    ) -> Generator[GenerationChunk, None, None]:
        if len(self.addresses) > 1:
            return self._stream_with_failover(request, timeout)
        return self._stream_once(request, timeout)

    def _stream_once(
        self, request: engine_pb2.GenerateRequest, timeout: float | None
    ) -> Generator[GenerationChunk, None, None]:
        call = self._stub.Generate(request, timeout=timeout or self.timeout)
        try:
            for message in call:
                yield GenerationChunk.from_pb(message)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()  # no-op once finished; frees the engine's row if we stop early

    def _stream_with_failover(
        self, request: engine_pb2.GenerateRequest, timeout: float | None
    ) -> Generator[GenerationChunk, None, None]:
        attempts = StreamAttempts(request, len(self.addresses), self.failover_wait_s)
        at = self._preferred
        while True:
            call = self._stub_at(at).Generate(attempts.request(), timeout=timeout or self.timeout)
            try:
                for message in call:
                    attempts.received(len(message.token_ids))
                    yield GenerationChunk.from_pb(message)
                return
            except grpc.RpcError as exc:
                step = attempts.after(exc.code())
                if step.move is Move.GIVE_UP:
                    raise from_rpc_error(exc) from None
            finally:
                call.cancel()
            if step.move is Move.NEXT_ADDRESS:
                at = self._moved_from(at)
            time.sleep(step.pause_s)

    def _call(self, fn: Callable[[], T]) -> T:
        """fn (reading `self._stub`), moving to the next address while the one it used is
        UNAVAILABLE."""
        for _ in self.addresses[1:]:
            at = self._preferred
            try:
                return super()._call(fn)
            except Unavailable:
                if self._preferred == at:  # no other call moved on meanwhile
                    self._moved_from(at)
        return super()._call(fn)

    def generate(
        self, prompt: str | Sequence[int] | Sequence[dict[str, str]], **options: Any
    ) -> Generation:
        return Generation.collect(self.stream(prompt, **options))

    def tokenize(
        self,
        text: str = "",
        messages: Sequence[Mapping[str, Any]] = (),
        add_special_tokens: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        req = engine_pb2.TokenizeRequest(
            text=text,
            add_special_tokens=add_special_tokens,
            messages=[chat_message(m) for m in messages],
        )
        req.tools.extend(tools_pb(tools or ()))
        r: engine_pb2.TokenizeResponse = self._call(lambda: self._stub.Tokenize(req))
        return list(r.token_ids)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        r: engine_pb2.DetokenizeResponse = self._call(
            lambda: self._stub.Detokenize(engine_pb2.DetokenizeRequest(token_ids=list(token_ids)))
        )
        return r.text

    def model_info(self) -> engine_pb2.ModelInfoResponse:
        r: engine_pb2.ModelInfoResponse = self._call(
            lambda: self._stub.ModelInfo(engine_pb2.ModelInfoRequest())
        )
        return r

    def cancel(self, request_id: str) -> None:
        self._call(lambda: self._stub.Cancel(engine_pb2.CancelRequest(request_id=request_id)))

    def flush(self) -> engine_pb2.EngineFlushResponse:
        """The engine's checkpoint durability barrier."""
        r: engine_pb2.EngineFlushResponse = self._call(
            lambda: self._stub.Flush(engine_pb2.EngineFlushRequest())
        )
        return r

    def stats(self) -> engine_pb2.EngineStatsResponse:
        r: engine_pb2.EngineStatsResponse = self._call(
            lambda: self._stub.Stats(engine_pb2.EngineStatsRequest())
        )
        return r
