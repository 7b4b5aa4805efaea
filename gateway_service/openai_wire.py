"""OpenAI's request and response shapes, translated to and from the Tandem engine API.

`completion_request` / `chat_request` turn a JSON body into a GenerateRequest (or raise
ApiError 400 naming the field; which fields exist at all is openai_fields.py's; tools are
openai_tools.py's); openai_chunks.py shapes the answers. Tandem's own options ride in
the body's `tandem` object (docs/gateway.md).
"""

from __future__ import annotations

import secrets
from typing import Any

from gateway_service.openai_errors import ApiError
from gateway_service.openai_tools import add_call_fields, add_tools
from tandem_wire.pb import engine_pb2

TANDEM_OPTIONS = {
    "namespace",
    "request_id",
    "checkpoint_interval",
    "resume",
    "tokens_held",
    "kv_bits",
    "kv_group_size",
    "quantized_kv_start",
    "kv_scheme",
    "kv_value_bits",
    "num_draft_tokens",
    "deterministic",  # batch-invariant logits: engines started with --deterministic only
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "regex",  # the constraint extras (openai_formats.py)
    "choice",
    "lark",
    "gbnf",
}


# The proto fields' ranges: a value beyond them cannot be set on the message (ValueError).
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38


def _number(
    body: dict[str, Any], name: str, kind: type, low: float | None = None, high: float | None = None
) -> Any:
    """body[name] as an int or float within [low, high] (None when absent). Ints default to
    int32's range and floats to float32's, the fields they are set on."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number", param=name)
    if high is None:
        high = INT32_MAX if kind is int else FLOAT32_MAX
    if low is None:
        low = -high
    if not (low <= value <= high):  # NaN fails too
        raise ApiError(
            400, f"'{name}' must be in [{low}, {high}], got {str(value)[:40]}", param=name
        )
    if kind is int and value != int(value):
        raise ApiError(400, f"'{name}' must be an integer", param=name)
    return kind(value)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false", param=name)
    return value


def _string(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string", param=name)
    return value


def _common(body: dict[str, Any], req: engine_pb2.GenerateRequest) -> None:
    s = req.sampling
    temperature = _number(body, "temperature", float, 0, 2)
    s.temperature = 1.0 if temperature is None else temperature  # OpenAI's default
    top_p = _number(body, "top_p", float, 0, 1)
    if top_p is not None and top_p < 1:
        if top_p <= 0:
            raise ApiError(400, "'top_p' must be > 0", param="top_p")
        s.top_p = top_p
    seed = _number(body, "seed", int, 0, 2**63 - 1)  # uint64 on the wire; mlx takes 63 bits
    # No seed: a random one, so a restart on another engine draws the same tokens.
    s.seed = secrets.randbits(63) if seed is None else seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop)
    ):
        raise ApiError(400, "'stop' must be a string or a list of non-empty strings", param="stop")
    s.stop.extend(stop or [])
    for name in ("presence_penalty", "frequency_penalty"):
        setattr(s, name, _number(body, name, float, -2, 2) or 0.0)
    for token, bias in _logit_bias(body.get("logit_bias")).items():
        s.logit_bias[token] = bias
    extra = body.get("tandem") or {}
    if not isinstance(extra, dict) or set(extra) - TANDEM_OPTIONS:
        unknown = sorted(set(extra) - TANDEM_OPTIONS) if isinstance(extra, dict) else extra
        raise ApiError(400, f"unknown 'tandem' options: {unknown}", param="tandem")
    for name in ("namespace", "request_id"):
        value = _string(extra, name)
        if value is not None:
            setattr(req, name, value)
    for name in ("checkpoint_interval", "tokens_held", "kv_group_size", "kv_value_bits"):
        if name in extra:
            setattr(req, name, _number(extra, name, int, 0))
    for name in ("kv_bits", "quantized_kv_start", "num_draft_tokens"):
        if name in extra:
            setattr(req, name, _number(extra, name, int, 0))
    req.resume = _flag(extra, "resume")
    req.deterministic = _flag(extra, "deterministic")
    if "kv_scheme" in extra:
        schemes = {
            "affine": engine_pb2.KV_SCHEME_AFFINE,
            "turboquant": engine_pb2.KV_SCHEME_TURBOQUANT,
        }
        if not isinstance(extra["kv_scheme"], str) or extra["kv_scheme"] not in schemes:
            raise ApiError(400, "'tandem.kv_scheme' must be affine or turboquant", param="tandem")
        req.kv_scheme = schemes[extra["kv_scheme"]]
    s.top_k = _number(extra, "top_k", int, 0) or 0
    s.min_p = _number(extra, "min_p", float, 0, 1) or 0.0
    s.repetition_penalty = _number(extra, "repetition_penalty", float, 0) or 0.0
    s.ignore_eos = _flag(extra, "ignore_eos")


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON object keys) -> bias, clamped to [-100, 100]
    as OpenAI does; the engine checks the ids against the vocabulary."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, "'logit_bias' must map token ids to numbers", param="logit_bias")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) <= INT32_MAX):
            raise ApiError(400, f"'logit_bias' key {key!r} is not a token id", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ApiError(400, f"'logit_bias' value for {key} is not a number", param="logit_bias")
        out[int(key)] = min(100.0, max(-100.0, float(bias)))
    return out


def _max_tokens(body: dict[str, Any], req: engine_pb2.GenerateRequest, *names: str) -> None:
    for name in names:
        value = _number(body, name, int, 1)
        if value is not None:
            req.max_tokens = value
            return


def completion_request(body: dict[str, Any]) -> engine_pb2.GenerateRequest:
    req = engine_pb2.GenerateRequest()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str) and prompt:
        req.text = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(type(t) is int and 0 <= t <= INT32_MAX for t in prompt)
    ):
        req.token_ids.extend(prompt)
    else:
        raise ApiError(
            400,
            "'prompt' must be one non-empty string or list of token ids (0..2^31-1)",
            param="prompt",
        )
    _common(body, req)
    _max_tokens(body, req, "max_tokens")
    logprobs = _number(body, "logprobs", int, 0, 20)
    if logprobs is not None:
        req.sampling.logprobs = logprobs
    return req


def chat_request(body: dict[str, Any]) -> engine_pb2.GenerateRequest:
    req = engine_pb2.GenerateRequest()
    add_messages(body.get("messages"), req.messages)
    add_tools(body, req)
    _common(body, req)
    _max_tokens(body, req, "max_completion_tokens", "max_tokens")
    if _flag(body, "logprobs"):
        req.sampling.logprobs = _number(body, "top_logprobs", int, 0, 20) or 0
    return req


def add_messages(messages: Any, into: Any) -> None:
    """A body's `messages` (text content, tool calls and answers) added to a repeated
    ChatMessage field."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] needs a 'role'", param="messages")
        add_call_fields(m, i, into.add(role=m["role"], content=_content(m.get("content"), i)))


def streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage)."""
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    return _flag(body, "stream"), _flag(options or {}, "include_usage")


def _content(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(
                    400, f"messages[{i}]: only text content parts are supported", param="messages"
                )
            text = part.get("text", "")
            if not isinstance(text, str):
                raise ApiError(
                    400, f"messages[{i}]: a part's 'text' must be a string", param="messages"
                )
            parts.append(text)
        return "".join(parts)
    raise ApiError(
        400, f"messages[{i}].content must be a string or a list of parts", param="messages"
    )
