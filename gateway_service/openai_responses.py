"""OpenAI's Responses API (`POST /v1/responses`): a request's `input` and `instructions`
become a chat request (openai_wire.chat_request: the same messages, tools and constraints),
and the engine's messages become a Response object or the Responses event stream
(openai_response_events.py).

`input` holds messages, the model's `function_call` items and the caller's
`function_call_output` items. A gateway started with `--store` also keeps each response's
history (conversations.py), so `previous_response_id` continues it; without one,
`previous_response_id` is refused by name and the caller sends the history. `conversation`
(OpenAI's stored conversation objects) is refused either way.
"""

from __future__ import annotations

from typing import Any

from gateway_service.openai_errors import ApiError
from gateway_service.openai_fields import Refused, refuse_unplaced

# Honoured: what the chat request takes, in the Responses API's names.
HONOURED = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "tandem",
}
# Accepted and ignored by design: none changes a token.
IGNORED = {
    "user": "an end-user id for the caller's own records",
    "metadata": "tags for OpenAI's stored responses",
    "store": "nothing is stored: send the history in `input` (previous_response_id is refused)",
    "service_tier": "OpenAI's capacity tiers",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "prompt_cache_key": "a caching hint: prefixes are reused whatever the key",
    "prompt_cache_retention": "a caching hint: prefixes are kept by the store's own policy",
    "prompt_cache_options": "a caching hint: prefixes are kept by the store's own policy",
}
STATELESS = "this gateway keeps no conversations (no --store): send the history in `input`"
REFUSED = {
    "previous_response_id": Refused(STATELESS),
    "conversation": Refused("conversation objects are not kept: send the history in `input`"),
    "background": Refused("background responses are not supported", (None, False)),
    "background_options": Refused("background responses are not supported"),
    "include": Refused("no extra output can be included", (None, [])),
    "max_tool_calls": Refused("the number of calls is bounded by parallel_tool_calls only"),
    "top_logprobs": Refused("logprobs are a chat completions field here", (None, 0)),
    "truncation": Refused("a prompt past the context is refused, never cut", (None, "disabled")),
    "reasoning": Refused("reasoning cannot be configured for these models", (None, {})),
    "prompt": Refused("stored prompt templates are not available"),
    "context_management": Refused("context management is not available"),
    "access_programs": Refused("not available"),
    "image": Refused("image output is not supported"),
    "moderation": Refused("moderation is not available"),
}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


KEPT = {"previous_response_id", "store"}  # honoured when the gateway keeps conversations


def check_response_fields(body: dict[str, Any], keeps_conversations: bool) -> None:
    if not keeps_conversations:
        refuse_unplaced(body, HONOURED, IGNORED, REFUSED, "/v1/responses")
        return
    ignored = {k: v for k, v in IGNORED.items() if k not in KEPT}
    refused = {k: v for k, v in REFUSED.items() if k not in KEPT}
    refuse_unplaced(body, HONOURED | KEPT, ignored, refused, "/v1/responses")
    for name, kind in (("previous_response_id", str), ("store", bool)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise ApiError(400, f"'{name}' must be a {kind.__name__}", param=name)


def chat_body(
    body: dict[str, Any], history: list[dict[str, Any]] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat completions body this request means (its fields already checked), and the
    conversation it continues: `history` (a previous response's), then this request's
    input. Instructions come first and are not part of the conversation (as OpenAI's: a
    later turn sends its own)."""
    turn = [*(history or []), *_input_messages(body)]
    chat: dict[str, Any] = {"messages": [*_instructions(body), *turn]}
    for name in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "tandem"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("stream") and isinstance(body.get("stream_options"), dict):
        chat["stream_options"] = {}  # include_obfuscation only: nothing to obfuscate here
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list", param="tools")
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat, turn


def _instructions(body: dict[str, Any]) -> list[dict[str, Any]]:
    instructions = body.get("instructions")
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string", param="instructions")
    return [{"role": "system", "content": instructions}]


def _input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    given = body.get("input")
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise ApiError(400, f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role", ""))
            if role is None:
                raise ApiError(
                    400, f"input[{i}]: role must be one of {sorted(ROLES)}", param="input"
                )
            out.append({"role": role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", i),
                "type": "function",
                "function": {
                    "name": _field(item, "name", i),
                    "arguments": _field(item, "arguments", i),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # calls made together: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, i)
            out.append(
                {"role": "tool", "tool_call_id": _field(item, "call_id", i), "content": text}
            )
        else:
            raise ApiError(
                400, f"input[{i}]: items of type {kind!r} are not supported", param="input"
            )
    return out


def _text(content: Any, i: int) -> str:
    """A message's content: text, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                raise ApiError(400, f"input[{i}]: only text parts are supported", param="input")
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"input[{i}]: a part's 'text' must be a string", param="input")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"input[{i}].content must be a string or a list of parts", param="input")


def _field(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"input[{i}] needs '{name}' (a string)", param="input")
    return value


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    """The Responses API's flat function tool as chat's nested one."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ApiError(400, f"tools[{i}]: only function tools are supported", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` (text, json_object, or a flat json_schema) as chat's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise ApiError(400, "'text' takes 'format' only", param="text")
    if text.get("verbosity") is not None:
        raise ApiError(400, "'text.verbosity' cannot be set for these models", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError(400, "'text.format' must be an object", param="text")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


def response_echo(body: dict[str, Any]) -> dict[str, Any]:
    """The request's settings a Response object repeats."""
    echo: dict[str, Any] = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "previous_response_id": body.get("previous_response_id"),
    }
    for name in ("tools", "tool_choice", "parallel_tool_calls", "text"):
        if body.get(name) is not None:
            echo[name] = body[name]
    return echo
