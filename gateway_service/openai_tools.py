"""OpenAI's tool calling, translated: a body's `tools`, `tool_choice` and
`parallel_tool_calls` and the history's calls and answers into the engine's request, and the
engine's call pieces (ToolCallDelta) into OpenAI's `tool_calls`, streamed and whole.

The engine renders the tools through the model's chat template, parses its calls and, for
`tool_choice` "required" or a named function, enforces one with a grammar
(engine_service/front/tools.py). The Responses API (openai_responses.py) comes here as a
chat request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway_service.openai_errors import ApiError
from tandem_wire.pb import engine_pb2

MODES = {
    "auto": engine_pb2.ToolChoice.MODE_AUTO,
    "none": engine_pb2.ToolChoice.MODE_NONE,
    "required": engine_pb2.ToolChoice.MODE_REQUIRED,
}


def add_tools(body: dict[str, Any], req: engine_pb2.GenerateRequest) -> None:
    """tools ({"type": "function", "function": {...}}), tool_choice and
    parallel_tool_calls."""
    req.tools.extend(tools_pb(body.get("tools")))
    _tool_choice(body.get("tool_choice"), req)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise ApiError(400, "'parallel_tool_calls' must be true or false", param="tools")
        if req.tools:
            req.parallel_tool_calls = parallel


def tools_pb(tools: Any) -> list[engine_pb2.Tool]:
    """A body's `tools` (checked) as the engine's Tool messages."""
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError(400, f"tools[{i}]: only function tools are supported", param="tools")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"tools[{i}] needs a function name", param="tools")
        description = function.get("description") or ""
        parameters = function.get("parameters")
        if not isinstance(description, str) or not isinstance(parameters, (dict, type(None))):
            raise ApiError(
                400, f"tools[{i}]: description is text, parameters an object", param="tools"
            )
        out.append(
            engine_pb2.Tool(
                name=function["name"],
                description=description,
                parameters_json=json.dumps(parameters) if parameters is not None else "",
            )
        )
    return out


def _tool_choice(choice: Any, req: engine_pb2.GenerateRequest) -> None:
    if choice is None:
        return
    if isinstance(choice, str) and choice in MODES:
        if req.tools or choice != "none":
            req.tool_choice.mode = MODES[choice]
        return
    function = choice.get("function") if isinstance(choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not named:
        raise ApiError(
            400,
            "'tool_choice' must be auto, none, required or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    req.tool_choice.mode = engine_pb2.ToolChoice.MODE_FUNCTION
    req.tool_choice.function_name = str(named)


def add_call_fields(m: dict[str, Any], i: int, message: engine_pb2.ChatMessage) -> None:
    """An assistant message's tool_calls, a tool message's tool_call_id (and name)."""
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise ApiError(400, f"messages[{i}].tool_calls must be a list", param="messages")
    for call in calls or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(
                400, f"messages[{i}]: a tool call needs a function name", param="messages"
            )
        arguments = function.get("arguments") or ""
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        message.tool_calls.add(
            id=str(call.get("id") or ""), name=function["name"], arguments=arguments
        )
    for name in ("tool_call_id", "name"):
        value = m.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise ApiError(400, f"messages[{i}].{name} must be a string", param="messages")
            setattr(message, name, value)


@dataclass
class ToolCalls:
    """One choice's calls as their pieces arrive."""

    calls: dict[int, dict[str, str]] = field(default_factory=dict)

    def add(self, deltas: Sequence[engine_pb2.ToolCallDelta]) -> list[dict[str, Any]]:
        """The pieces of one engine message, as OpenAI's delta.tool_calls: one entry per call
        it touched, id, type and name on a call's first, arguments in pieces."""
        out: dict[int, dict[str, Any]] = {}
        for d in deltas:
            whole = self.calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            entry = out.setdefault(d.index, {"index": d.index, "function": {"arguments": ""}})
            if d.id:
                whole["id"], whole["name"] = d.id, d.name
                entry.update(id=d.id, type="function")
                entry["function"] = {"name": d.name, "arguments": entry["function"]["arguments"]}
            whole["arguments"] += d.arguments
            entry["function"]["arguments"] += d.arguments
        return list(out.values())

    def whole(self) -> list[dict[str, Any]]:
        """The message's tool_calls, for a response that does not stream."""
        return [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for _, c in sorted(self.calls.items())
        ]

    def __bool__(self) -> bool:
        return bool(self.calls)
