"""A request's tools, tool choice and chat history read from protobuf (the tool half of
front/wire.py; the domain is front/tools.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engine_service.errors import InvalidRequest
from engine_service.front.tools import MAX_TOOLS, NAME, ChoiceMode, ToolSpec, ToolUse
from tandem_wire.pb import engine_pb2

MODES = {
    engine_pb2.ToolChoice.MODE_AUTO: ChoiceMode.AUTO,
    engine_pb2.ToolChoice.MODE_NONE: ChoiceMode.NONE,
    engine_pb2.ToolChoice.MODE_REQUIRED: ChoiceMode.REQUIRED,
    engine_pb2.ToolChoice.MODE_FUNCTION: ChoiceMode.FUNCTION,
}


def tool_use_from_pb(request: engine_pb2.GenerateRequest) -> ToolUse | None:
    """The request's tools and choice, checked (no tokenizer needed); None without tools."""
    choice = request.tool_choice
    if not request.tools:
        if choice.mode != engine_pb2.ToolChoice.MODE_AUTO or choice.function_name:
            raise InvalidRequest("tool_choice needs tools")
        if request.HasField("parallel_tool_calls"):
            raise InvalidRequest("parallel_tool_calls needs tools")
        return None
    if not request.messages:
        raise InvalidRequest("tools need a chat request (messages)")
    tools = tools_from_pb(request.tools)
    mode = MODES.get(choice.mode)
    if mode is None:
        raise InvalidRequest(f"unknown tool_choice mode {choice.mode}")
    if mode is ChoiceMode.FUNCTION:
        if choice.function_name not in {t.name for t in tools}:
            raise InvalidRequest(f"tool_choice names {choice.function_name!r}, not one of tools")
    elif choice.function_name:
        raise InvalidRequest("tool_choice.function_name goes with MODE_FUNCTION only")
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return ToolUse(tools, mode, choice.function_name, parallel)


def tools_from_pb(tools: Sequence[engine_pb2.Tool]) -> tuple[ToolSpec, ...]:
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"{len(tools)} tools; at most {MAX_TOOLS}")
    specs: list[ToolSpec] = []
    for tool in tools:
        if not NAME.fullmatch(tool.name):
            raise InvalidRequest(
                f"tool name {tool.name[:80]!r}: 1-64 characters of a-z, A-Z, 0-9, _ and -"
            )
        parameters = _json(tool.parameters_json, f"tool {tool.name}'s parameters_json") or {
            "type": "object"
        }
        if not isinstance(parameters, dict):
            raise InvalidRequest(f"tool {tool.name}'s parameters_json must be a JSON object")
        specs.append(ToolSpec(tool.name, tool.description, parameters))
    if len({s.name for s in specs}) < len(specs):
        raise InvalidRequest("tool names must be unique")
    return tuple(specs)


def chat_messages(messages: Sequence[engine_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: an assistant's calls with their arguments as an
    object (HF's convention), a tool's answer with the call it answers."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if not m.role:
            raise InvalidRequest("every chat message needs a role")
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": _json(call.arguments, f"tool call {call.name}'s arguments")
                        or {},
                    },
                }
                for call in m.tool_calls
            ]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


def _json(text: str, what: str) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{what} is not valid JSON: {exc}") from None
