"""Tool calling in the client: tools and chat history from OpenAI-shaped dicts into the
request, and a generation's streamed call pieces merged back into whole calls."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem_wire.pb import engine_pb2

_MODES = {
    "auto": engine_pb2.ToolChoice.MODE_AUTO,
    "none": engine_pb2.ToolChoice.MODE_NONE,
    "required": engine_pb2.ToolChoice.MODE_REQUIRED,
}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it

    def parsed_arguments(self) -> Any:
        return json.loads(self.arguments)


def chat_message(m: Mapping[str, Any]) -> engine_pb2.ChatMessage:
    """A chat message from a dict: role and content, and OpenAI's tool_calls (an assistant's)
    or tool_call_id and name (a tool's answer)."""
    message = engine_pb2.ChatMessage(
        role=m["role"],
        content=m.get("content") or "",
        tool_call_id=m.get("tool_call_id") or "",
        name=m.get("name") or "",
    )
    for call in m.get("tool_calls") or ():
        function = call.get("function", call)
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        message.tool_calls.add(id=call.get("id", ""), name=function["name"], arguments=arguments)
    return message


def put_tools(
    req: engine_pb2.GenerateRequest,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool | None,
) -> None:
    """tools: OpenAI's shape ({"type": "function", "function": {...}}) or the function alone.
    tool_choice: "auto", "none", "required", a function's name, or OpenAI's
    {"type": "function", "function": {"name": ...}}."""
    req.tools.extend(tools_pb(tools or ()))
    if isinstance(tool_choice, Mapping):
        tool_choice = str(tool_choice.get("function", tool_choice)["name"])
    if tool_choice in _MODES:
        req.tool_choice.mode = _MODES[tool_choice]
    elif tool_choice is not None:
        req.tool_choice.mode = engine_pb2.ToolChoice.MODE_FUNCTION
        req.tool_choice.function_name = tool_choice
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls


def tools_pb(tools: Sequence[Mapping[str, Any]]) -> list[engine_pb2.Tool]:
    """Tools in OpenAI's shape ({"type": "function", "function": {...}}) or functions alone."""
    out = []
    for tool in tools:
        function = tool.get("function", tool)
        parameters = function.get("parameters")
        out.append(
            engine_pb2.Tool(
                name=function["name"],
                description=function.get("description") or "",
                parameters_json=json.dumps(parameters) if parameters is not None else "",
            )
        )
    return out


def merge_tool_calls(deltas: Iterable[engine_pb2.ToolCallDelta | Any]) -> list[ToolCall]:
    """Whole calls from their pieces, in index order."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        call["id"] = call["id"] or d.id
        call["name"] = call["name"] or d.name
        call["arguments"] += d.arguments
    return [ToolCall(**calls[i]) for i in sorted(calls)]
