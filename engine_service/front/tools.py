"""Tool calling, the request side: the tools a chat request offers, checked and rendered
through the model's chat template, and for a forced call the grammar that enforces it.

mlx-lm knows a model's tool-call format from its chat template (TokenizerWrapper:
`tool_call_start`, `tool_call_end`, `tool_parser`, one of mlx_lm/tool_parsers/*); a model
whose template renders no tools, or whose format mlx-lm does not parse, is refused
(FAILED_PRECONDITION) rather than shown tools it would ignore. Calls are parsed from the
answer by front/tool_calls.py.

A forced call (tool_choice REQUIRED or a named function) is a Lark grammar over the format's
markers with each function's JSON Schema for its arguments: every token the model makes is a
step of a valid call, and a resumed generation replays its tokens through the same grammar
(its state is rebuilt, never lost with the engine). Grammars are written for the JSON call
format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: Qwen2.5/3, Hermes, and the
many templates that copy them); another format forced is FAILED_PRECONDITION.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_service.errors import Precondition
from engine_service.protocol.constraint import Constraint, ConstraintKind

MAX_TOOLS = 128  # as OpenAI
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
JSON_FORMAT_PARSER = "mlx_lm.tool_parsers.json_tools"
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ChoiceMode(enum.Enum):
    AUTO = "auto"  # the model decides; its calls are parsed
    NONE = "none"  # tools shown, nothing parsed
    REQUIRED = "required"  # at least one call, grammar-enforced
    FUNCTION = "function"  # the named function, grammar-enforced


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON Schema of the arguments

    def for_template(self) -> dict[str, Any]:
        """The shape chat templates (and mlx-lm's parsers) expect: OpenAI's."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    tools: tuple[ToolSpec, ...]
    mode: ChoiceMode
    function: str  # ChoiceMode.FUNCTION: the one to call
    parallel: bool

    def for_template(self) -> list[dict[str, Any]]:
        return [tool.for_template() for tool in self.tools]


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes a call, as mlx-lm reads it."""

    start: str
    end: str
    parse: Callable[[str, Any], Any]  # mlx-lm's parse_tool_call(text, tools)
    json_body: bool  # <start>{"name": ..., "arguments": ...}<end>: streamed and grammars


def tool_format(tokenizer: Any) -> ToolFormat | None:
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    parse = tokenizer.tool_parser
    json_body = getattr(parse, "__module__", "") == JSON_FORMAT_PARSER
    return ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, parse, json_body)


def require_format(tokenizer: Any) -> ToolFormat:
    """The model's format, or FAILED_PRECONDITION: it cannot take tools at all."""
    fmt = tool_format(tokenizer)
    if fmt is None:
        raise Precondition(
            "this model's chat template has no tool-call format mlx-lm parses (tools need "
            "a model whose template renders them: Qwen2.5/3, Llama 3.1+, Mistral, ...)"
        )
    return fmt


def check_format(use: ToolUse, tokenizer: Any) -> ToolFormat:
    """The model's format, or FAILED_PRECONDITION: it cannot take these tools."""
    fmt = require_format(tokenizer)
    if use.mode in (ChoiceMode.REQUIRED, ChoiceMode.FUNCTION) and not fmt.json_body:
        raise Precondition(
            f"a forced tool call is enforced by a grammar written for the JSON call format "
            f"({fmt.start}{{...}}{fmt.end} with a JSON object); this model writes calls as "
            f"{fmt.parse.__module__.rsplit('.', 1)[-1]}: use tool_choice auto"
        )
    return fmt


def tool_constraint(use: ToolUse, fmt: ToolFormat, tokenizer: Any) -> Constraint | None:
    """The grammar of a forced call (None: the model decides). Each call is the format's
    markers around {"name": <a function>, "arguments": <its schema>}, name first (as the
    templates show it, and as front/tool_calls.py streams it)."""
    if use.mode not in (ChoiceMode.REQUIRED, ChoiceMode.FUNCTION):
        return None
    tools = [t for t in use.tools if use.mode is ChoiceMode.REQUIRED or t.name == use.function]
    bodies = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = dict(bodies[0]) if len(bodies) == 1 else {"anyOf": bodies}
    # The calls' JSON as the templates write it (json.dumps's separators), and no runs of
    # whitespace a model could fill a call with.
    schema["x-guidance"] = CALL_JSON
    # Qwen's layout: the markers on lines of their own; calls one after another.
    start, end = _marker(fmt.start, tokenizer), _marker(fmt.end, tokenizer)
    repeat = ' ("\\n" call)*' if use.parallel else ""
    grammar = (
        f"start: call{repeat}\n"
        f'call: {start} "\\n" body "\\n" {end}\n'
        f"body: %json {json.dumps(schema)}\n"
    )
    return Constraint(ConstraintKind.LARK, source=grammar)


def _marker(marker: str, tokenizer: Any) -> str:
    """A marker in Lark: its token when the tokenizer has it as one added token (Qwen's
    `<tool_call>` is; llguidance matches added tokens by id, never by their text), else its
    text."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    if len(ids) == 1 and marker in tokenizer.get_added_vocab():
        return f"<[{ids[0]}]>"
    return json.dumps(marker)


def call_id(request_id: str, index: int) -> str:
    """The same id for the same call however often the generation is resumed."""
    digest = hashlib.blake2b(f"{request_id}\0{index}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"
