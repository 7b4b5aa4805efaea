"""The engine's protobuf requests into its domain types, validated (InvalidRequest /
Precondition name what is wrong). Responses, stats, model info and flush results go out
through front/wire_out.py. No other engine module imports `engine_pb2` but those two,
front/tool_wire.py (a request's tools) and the servicer.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from typing import Any

from engine_service.config import MAX_DRAFT
from engine_service.errors import InvalidRequest, Precondition
from engine_service.front.policy import RequestPolicy
from engine_service.front.tool_wire import chat_messages, tool_use_from_pb, tools_from_pb
from engine_service.front.tools import check_format, require_format, tool_constraint
from engine_service.model.loaded import LoadedModel
from engine_service.protocol.constraint import Constraint, ConstraintKind, check_constraint
from engine_service.protocol.kv_codec import KVCodec, Scheme, checked_codec, request_layout
from engine_service.protocol.requests import (
    GenerationRequest,
    RecordFormat,
    checked_record_format,
    stop_token_ids,
)
from engine_service.protocol.sampling_options import SamplingOptions
from tandem_wire.limits import MAX_REQUEST_ID_CHARS, namespace_problem
from tandem_wire.pb import engine_pb2

MAX_STOPS = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024


# -- requests in ---------------------------------------------------------------------------


SCHEMES_PB = {
    engine_pb2.KV_SCHEME_AFFINE: Scheme.AFFINE,
    engine_pb2.KV_SCHEME_TURBOQUANT: Scheme.TURBOQUANT,
}


def _check_ids(ids: Any, vocab: int, what: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(
            f"{what} has unknown token ids {bad[:5]} (vocabulary is 0..{vocab - 1})"
        )


def sampling_from_pb(p: engine_pb2.SamplingParams, vocab: int) -> SamplingOptions:
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {p.temperature}")
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if not (0.0 < top_p <= 1.0):
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    if p.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0, got {p.top_k}")
    if not (0.0 <= p.min_p < 1.0):
        raise InvalidRequest(f"min_p must be in [0, 1), got {p.min_p}")
    if not math.isfinite(p.repetition_penalty) or p.repetition_penalty < 0:
        raise InvalidRequest(f"repetition_penalty must be >= 0, got {p.repetition_penalty}")
    if p.repetition_context_size < 0:
        raise InvalidRequest("repetition_context_size must be >= 0")
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(p, name)):
            raise InvalidRequest(f"{name} must be finite")
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
    _check_ids(list(p.logit_bias), vocab, "logit_bias")
    if not all(math.isfinite(bias) for bias in p.logit_bias.values()):
        raise InvalidRequest("logit_bias values must be finite")
    logprobs = p.logprobs if p.HasField("logprobs") else -1  # -1: unset, internally
    if p.HasField("logprobs") and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in 0..{MAX_LOGPROBS} (or unset), got {logprobs}")
    if len(p.stop) > MAX_STOPS or any(not s for s in p.stop):
        raise InvalidRequest(f"stop takes at most {MAX_STOPS} non-empty strings")
    _check_ids(p.stop_token_ids, vocab, "stop_token_ids")
    return SamplingOptions(
        temperature=p.temperature,
        top_p=top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        repetition_context_size=p.repetition_context_size or 20,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        seed=p.seed,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        logprobs=logprobs,
        ignore_eos=p.ignore_eos,
    )


def kv_codec_from_pb(
    request: engine_pb2.GenerateRequest, loaded: LoadedModel, default: KVCodec
) -> KVCodec:
    """The request's KV codec: its own fields over the engine's defaults."""
    bits = request.kv_bits if request.HasField("kv_bits") else default.bits
    group = request.kv_group_size or default.group_size
    start = request.quantized_kv_start if request.HasField("quantized_kv_start") else default.start
    if request.kv_scheme not in (engine_pb2.KV_SCHEME_UNSPECIFIED, *SCHEMES_PB):
        raise InvalidRequest(f"kv_scheme {request.kv_scheme} is not a KVScheme")
    scheme = SCHEMES_PB.get(request.kv_scheme, default.scheme)
    value_bits = request.kv_value_bits
    if not value_bits and scheme is default.scheme and bits == default.bits:
        value_bits = default.value_bits
    try:
        codec = checked_codec(bits, group, start, scheme, value_bits)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    if not codec.quantized:
        return codec
    # What the core's start-up probe found this model's attention cannot run
    # (protocol/capabilities.py).
    refusal = loaded.capabilities.refusal(codec)
    if refusal:
        raise InvalidRequest(refusal)
    return codec


def constraint_from_pb(
    request: engine_pb2.GenerateRequest, policy: RequestPolicy
) -> Constraint | None:
    """The request's structured-output constraint, its shape and size checked (microseconds).
    The core compiles it where it runs, before it takes a batch slot: a grammar that does not
    compile is refused from there (INVALID_ARGUMENT with the library's message)."""
    which = request.constraint.WhichOneof("kind") if request.HasField("constraint") else None
    if which is None:
        return None
    c = request.constraint
    if which == "choice":
        constraint = Constraint(ConstraintKind.CHOICE, choices=tuple(c.choice.options))
    elif which == "json_object":
        constraint = Constraint(ConstraintKind.JSON_OBJECT)
    else:
        constraint = Constraint(ConstraintKind(which), source=getattr(c, which))
    check_constraint(constraint)
    return constraint


def rolls_back(layout_id: str) -> bool:
    """Whether a layer of this layout can give rejected draft positions back in the
    speculative batch: plain KV, rings without kept tokens, recurrent state (restored)."""
    return (
        layout_id == "kv:plain"
        or layout_id.startswith("ssm:arrays:")
        or (layout_id.startswith("kv:rotating:") and layout_id.endswith(":0"))
    )


def num_draft_from_pb(request: engine_pb2.GenerateRequest, policy: RequestPolicy) -> int:
    """Draft tokens per round for this request (0: no speculation)."""
    drafts = policy.drafts
    n = request.num_draft_tokens if request.HasField("num_draft_tokens") else drafts.default
    if not 0 <= n <= MAX_DRAFT:
        raise InvalidRequest(f"num_draft_tokens must be in 0..{MAX_DRAFT}, got {n}")
    if not n:
        return 0
    if not drafts.model_id:
        raise Precondition("speculative decoding needs an engine started with --draft-model")
    cannot = sorted({c for c in policy.loaded.layout if not rolls_back(c)})
    if cannot:
        raise Precondition(
            f"speculative decoding rolls back rejected tokens, which {cannot} layers "
            "cannot do (rings that keep tokens, and nested caches)"
        )
    return int(n)


def prompt_from_pb(
    request: engine_pb2.GenerateRequest | engine_pb2.TokenizeRequest, loaded: LoadedModel
) -> list[int]:
    """The prompt as token ids: given ids, or encoded text, or rendered chat messages.

    Runs the tokenizer (and the chat template), so call it off the event loop.
    """
    tokenizer = loaded.tokenizer
    ids = list(getattr(request, "token_ids", []))
    given = [bool(request.text), bool(ids), bool(request.messages)]
    if sum(given) > 1:
        raise InvalidRequest("give exactly one of text, token_ids or messages")
    if request.messages:
        if not tokenizer.has_chat_template:
            raise Precondition("this model has no chat template; send text or token_ids")
        tools = None
        if request.tools:
            require_format(tokenizer)
            tools = [tool.for_template() for tool in tools_from_pb(request.tools)]
        rendered = tokenizer.apply_chat_template(
            chat_messages(request.messages), tools=tools, add_generation_prompt=True, tokenize=True
        )
        return list(rendered["input_ids"] if isinstance(rendered, dict) else rendered)
    if request.tools:
        raise InvalidRequest("tools need a chat request (messages)")
    if request.text:
        add_special = getattr(request, "add_special_tokens", True)
        return list(tokenizer.encode(request.text, add_special_tokens=add_special))
    return ids


def needs_tokenizer(request: engine_pb2.GenerateRequest) -> bool:
    """Text and chat prompts run the tokenizer or a chat template, constraints compile; token
    ids only checks."""
    return bool(request.text or request.messages or request.HasField("constraint"))


def request_from_pb(
    request: engine_pb2.GenerateRequest, policy: RequestPolicy, deadline: float | None
) -> GenerationRequest:
    loaded = policy.loaded
    if (request.resume or request.checkpoint_interval) and not policy.has_store:
        raise Precondition("checkpoints and resume need an engine started with --store")
    if request.resume and not request.request_id:
        raise InvalidRequest("resume needs the request_id of the generation to resume")
    if request.checkpoint_interval < 0 or request.tokens_held < 0:
        raise InvalidRequest("checkpoint_interval and tokens_held must be >= 0")
    if request.max_tokens < 0 or (request.max_tokens == 0 and request.HasField("max_tokens")):
        raise InvalidRequest(f"max_tokens must be > 0, got {request.max_tokens}")
    if len(request.request_id) > MAX_REQUEST_ID_CHARS or not request.request_id.isprintable():
        raise InvalidRequest(
            f"request_id must be up to {MAX_REQUEST_ID_CHARS} printable characters"
        )
    problem = namespace_problem(request.namespace)
    if problem:
        raise InvalidRequest(problem)
    sampling = sampling_from_pb(request.sampling, loaded.vocab_size)
    constraint = constraint_from_pb(request, policy)
    use = tool_use_from_pb(request)
    if use is not None:
        forced = tool_constraint(use, check_format(use, loaded.tokenizer), loaded.tokenizer)
        if forced is not None and constraint is not None:
            raise InvalidRequest(
                "a forced tool call is a grammar of its own: drop the constraint "
                "(response_format), or use tool_choice auto"
            )
        constraint = constraint or forced
    if constraint is not None:
        sampling = dataclasses.replace(sampling, constraint=constraint)
    if request.deterministic and not policy.deterministic:
        raise Precondition("deterministic requests need an engine started with --deterministic")
    kv = kv_codec_from_pb(request, loaded, policy.default_kv)
    num_draft = num_draft_from_pb(request, policy)
    if constraint is not None and num_draft:
        if request.HasField("num_draft_tokens"):
            raise Precondition("a constrained generation does not speculate; omit num_draft_tokens")
        num_draft = 0  # the engine's default speculation is for unconstrained requests
    prompt = prompt_from_pb(request, loaded)
    if not prompt:
        raise InvalidRequest("the prompt is empty")
    _check_ids(prompt, loaded.vocab_size, "the prompt")
    if len(prompt) >= policy.context:
        raise InvalidRequest(
            f"the prompt has {len(prompt)} tokens; the context is {policy.context} "
            "(limit: --max-context)"
        )
    max_tokens = min(request.max_tokens or policy.default_max_tokens, policy.context - len(prompt))
    if request.tokens_held > max_tokens:
        # A client can't hold more tokens than the generation can make. It may hold more than
        # the checkpoint covers: those are made again (same numbers) and not sent twice.
        raise InvalidRequest(
            f"tokens_held {request.tokens_held} exceeds the generation's max_tokens {max_tokens}"
        )
    interval = request.checkpoint_interval or (
        policy.default_checkpoint_interval if policy.has_store else 0
    )
    return GenerationRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        namespace=request.namespace or "default",
        stop_ids=stop_token_ids(sampling, loaded.eos_token_ids),
        deadline=deadline,
        checkpoint_interval=interval,
        resume=request.resume,
        tokens_held=request.tokens_held,
        kv=kv,
        layout=request_layout(loaded.layout, kv),
        num_draft=num_draft,
        prefix_record=record_format(request),
    )


def record_format(request: engine_pb2.GenerateRequest) -> RecordFormat:
    """The prefix record's format: affine codes unless the request names TurboQuant."""
    scheme = request.prefix_record_scheme
    if scheme not in (engine_pb2.KV_SCHEME_UNSPECIFIED, *SCHEMES_PB):
        raise InvalidRequest(f"prefix_record_scheme {scheme} is not a KVScheme")
    return checked_record_format(request.prefix_record_bits, SCHEMES_PB.get(scheme, Scheme.AFFINE))


def detokenize_ids(request: engine_pb2.DetokenizeRequest, loaded: LoadedModel) -> list[int]:
    ids = list(request.token_ids)
    bad = [t for t in ids if not 0 <= t < loaded.vocab_size]
    if bad:
        raise InvalidRequest(f"unknown token ids {bad[:5]}")
    return ids
