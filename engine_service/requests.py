"""A generation request as the engine sees it, validated from its wire form."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine_service.errors import InvalidRequest, Precondition
from engine_service.model import LoadedModel
from engine_service.quantized_kv import BITS, GROUP_SIZES, PLAIN_KV, KVCodec, request_layout
from engine_service.sampling import SamplingOptions
from engine_service.speculative import MAX_DRAFT
from tandem_wire.pb import engine_pb2

MAX_STOPS = 16
MAX_LOGPROBS = 20


@dataclass
class GenerationRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingOptions
    namespace: str
    # Absolute time.monotonic() by which the client stops waiting, or None.
    deadline: float | None = None
    checkpoint_interval: int = 0
    resume: bool = False
    tokens_held: int = 0
    kv: KVCodec = KVCodec()
    layout: list[str] = field(default_factory=list)  # the model's layout under `kv`
    num_draft: int = 0  # speculative decoding: draft tokens per round (0: off)

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.sampling.stop_token_ids)


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
    logprobs = p.logprobs if p.HasField("logprobs") else -1
    if not -1 <= logprobs <= MAX_LOGPROBS:
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
    if bits not in (0, *BITS):
        raise InvalidRequest(f"kv_bits must be 0 (plain), 4 or 8, got {bits}")
    if group not in GROUP_SIZES:
        raise InvalidRequest(f"kv_group_size must be 32, 64 or 128, got {group}")
    if start < 0:
        raise InvalidRequest(f"quantized_kv_start must be >= 0, got {start}")
    if not bits:
        return KVCodec()
    if "kv:plain" not in loaded.layout:
        raise Precondition(
            f"this model has no plain KV layers to quantize (layout {sorted(set(loaded.layout))})"
        )
    bad = [d for d in loaded.kv_head_dims if d % group]
    if bad:
        raise InvalidRequest(
            f"kv_group_size {group} does not divide the model's head dimension {bad[0]}"
        )
    return KVCodec(bits, group, start)


def num_draft_from_pb(
    request: engine_pb2.GenerateRequest, loaded: LoadedModel, drafts: DraftSupport, kv: KVCodec
) -> int:
    """Draft tokens per round for this request (0: no speculation)."""
    n = request.num_draft_tokens if request.HasField("num_draft_tokens") else drafts.default
    if not 0 <= n <= MAX_DRAFT:
        raise InvalidRequest(f"num_draft_tokens must be in 0..{MAX_DRAFT}, got {n}")
    if not n:
        return 0
    if not drafts.model_id:
        raise Precondition("speculative decoding needs an engine started with --draft-model")
    untrimmable = sorted({c for c in loaded.layout if c != "kv:plain"})
    if untrimmable:
        raise Precondition(
            f"speculative decoding rolls back rejected tokens, which {untrimmable} layers "
            "cannot do (sliding-window and recurrent caches are not trimmable)"
        )
    if kv.quantized:
        raise Precondition("speculative decoding runs on plain KV caches; send kv_bits=0")
    return int(n)


@dataclass(frozen=True)
class DraftSupport:
    """What the engine offers for speculative decoding."""

    model_id: str = ""  # "" when no draft model is loaded
    default: int = 0


def prompt_tokens(
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
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        if any(not m["role"] for m in messages):
            raise InvalidRequest("every chat message needs a role")
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        return list(rendered["input_ids"] if isinstance(rendered, dict) else rendered)
    if request.text:
        add_special = getattr(request, "add_special_tokens", True)
        return list(tokenizer.encode(request.text, add_special_tokens=add_special))
    return ids


def request_from_pb(
    request: engine_pb2.GenerateRequest,
    loaded: LoadedModel,
    context: int,
    default_max_tokens: int,
    deadline: float | None,
    has_store: bool = False,
    default_interval: int = 0,
    default_kv: KVCodec = PLAIN_KV,
    drafts: DraftSupport | None = None,
) -> GenerationRequest:
    if (request.resume or request.checkpoint_interval) and not has_store:
        raise Precondition("checkpoints and resume need an engine started with --store")
    if request.resume and not request.request_id:
        raise InvalidRequest("resume needs the request_id of the generation to resume")
    if request.checkpoint_interval < 0 or request.tokens_held < 0:
        raise InvalidRequest("checkpoint_interval and tokens_held must be >= 0")
    if request.max_tokens < 0 or (request.max_tokens == 0 and request.HasField("max_tokens")):
        raise InvalidRequest(f"max_tokens must be > 0, got {request.max_tokens}")
    if len(request.request_id) > 128 or not request.request_id.isprintable():
        raise InvalidRequest("request_id must be up to 128 printable characters")
    sampling = sampling_from_pb(request.sampling, loaded.vocab_size)
    kv = kv_codec_from_pb(request, loaded, default_kv)
    num_draft = num_draft_from_pb(request, loaded, drafts or DraftSupport(), kv)
    prompt = prompt_tokens(request, loaded)
    if not prompt:
        raise InvalidRequest("the prompt is empty")
    _check_ids(prompt, loaded.vocab_size, "the prompt")
    if len(prompt) >= context:
        raise InvalidRequest(
            f"the prompt has {len(prompt)} tokens; the context is {context} (limit: --max-context)"
        )
    max_tokens = min(request.max_tokens or default_max_tokens, context - len(prompt))
    return GenerationRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        namespace=request.namespace or "default",
        deadline=deadline,
        checkpoint_interval=request.checkpoint_interval or (default_interval if has_store else 0),
        resume=request.resume,
        tokens_held=request.tokens_held,
        kv=kv,
        layout=request_layout(loaded.layout, kv),
        num_draft=num_draft,
    )
