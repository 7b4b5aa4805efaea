"""Every field an OpenAI request body may hold, and what the gateway does with it: honoured,
refused with a 400 that names it, or accepted and ignored because it cannot change the output.

The most common complaint against OpenAI-compatible servers is a field answered 200 and
silently ignored. Here nothing is: a field not listed is refused as unknown, and
tests/test_openai_fields.py walks the `openai` SDK's request types so that a field a new
SDK sends fails a test until it is placed in one of these lists. docs/gateway.md has the
table; keep the two together.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from gateway_service.openai_errors import ApiError


class Endpoint(Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


# Honoured by both routes. `tandem` holds our own options; `grammar` (GBNF) and `json_schema`
# are llama.cpp's server's extensions, mapped onto the same constraints (openai_formats.py).
_BOTH = {
    "model",
    "n",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "max_tokens",
    "logprobs",
    "stream",
    "stream_options",
    "response_format",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "grammar",
    "json_schema",
    "tandem",
}
HONOURED = {
    Endpoint.COMPLETIONS: _BOTH | {"prompt", "echo"},
    Endpoint.CHAT: _BOTH
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
}

# Accepted and ignored by design: none of them changes a token of the output.
IGNORED = {
    "user": "an end-user id for the caller's own records",
    "metadata": "tags for OpenAI's stored completions",
    "store": "OpenAI's stored completions (Tandem keeps checkpoints by request id instead)",
    "service_tier": "OpenAI's capacity tiers",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "prompt_cache_key": "a caching hint: prefixes are reused whatever the key",
    "prompt_cache_retention": "a caching hint: prefixes are kept by the store's own policy",
    "prompt_cache_options": "a caching hint: prefixes are kept by the store's own policy",
    "prediction": "predicted output speeds decoding up; it never changes the tokens",
}


@dataclass(frozen=True)
class Refused:
    """A field refused unless it holds one of its neutral values (what leaving it out means)."""

    why: str
    neutral: tuple[Any, ...] = (None,)


REFUSED = {
    "best_of": Refused("only one candidate per request (best_of = 1)", (None, 1)),
    "echo": Refused("echo is a completions field", (None, False)),
    "suffix": Refused("insertion (a suffix) is not supported", (None, "")),
    "tools": Refused("tools are a chat field", (None, [])),
    "tool_choice": Refused("tools are a chat field", (None, "none", "auto")),
    "parallel_tool_calls": Refused("tools are a chat field", (None, True, False)),
    "functions": Refused("the deprecated `functions` API: send `tools`", (None, [])),
    "function_call": Refused(
        "the deprecated `functions` API: send `tool_choice`", (None, "none", "auto")
    ),
    "modalities": Refused("text is the only modality", (None, ["text"])),
    "audio": Refused("audio output is not supported"),
    "reasoning_effort": Refused("reasoning effort cannot be set for these models"),
    "verbosity": Refused("verbosity cannot be set for these models"),
    "web_search_options": Refused("web search is not available"),
    "moderation": Refused("moderation is not available"),
}


def check_fields(body: dict[str, Any], endpoint: Endpoint) -> None:
    """ApiError 400 naming the first field that is neither honoured, ignored by design, nor
    at a neutral value; or `stream_options` without `stream`, as OpenAI answers."""
    refuse_unplaced(body, HONOURED[endpoint], IGNORED, REFUSED, endpoint.value)


def refuse_unplaced(
    body: dict[str, Any],
    honoured: set[str],
    ignored: dict[str, str],
    refused: dict[str, Refused],
    route: str,
) -> None:
    """check_fields for one route's lists (the Responses API has its own)."""
    for name, value in body.items():
        if name in honoured or name in ignored:
            continue
        refusal = refused.get(name)
        if refusal is None:
            raise ApiError(400, f"unknown field '{name}' for {route}", param=name)
        if not any(_same(value, neutral) for neutral in refusal.neutral):
            raise ApiError(400, f"'{name}': {refusal.why}", param=name)
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise ApiError(
            400, "'stream_options' is only allowed when 'stream' is true", param="stream_options"
        )


def _same(value: Any, neutral: Any) -> bool:
    # 0 == False and 1 == True in Python: compare types too, but let an int stand for a float.
    numbers = (int, float)
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    if isinstance(value, numbers) and isinstance(neutral, numbers):
        return bool(value == neutral)
    return type(value) is type(neutral) and value == neutral
