"""Tool calls cut out of a chat answer as it streams, in OpenAI's delta shape.

Text between the model's call markers (front/tools.py: ToolFormat) is a call, not content.
For the JSON call format, written name first (`{"name": "f", "arguments": {...}}`, the way
the templates show it and the forced grammar makes it), a call streams: its id and name as
soon as the name is complete, then its arguments as the model writes them, minus a tail of
`}` and whitespace that may be the call object's own end. Any other format or layout is
parsed whole when the call closes, with mlx-lm's parser for the model's format, and sent as
one piece; a call that does not parse goes back into the content, markers and all (logged),
never dropped.

The split is fed every piece of text the generation makes, a resumed generation's replayed
tokens included (response_stream.py discards what the client already holds), so a call's
index, id and position in its arguments are the same on the engine that resumes it. Ids are
derived from the request id and the index (tools.call_id) for the same reason.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from engine_service.front.reasoning import open_prefix
from engine_service.front.tools import ChoiceMode, ToolFormat, ToolUse, call_id, tool_format

log = logging.getLogger(__name__)

# A JSON call's opening up to its arguments, name first.
NAME_THEN_ARGUMENTS = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*'
)
CLOSING = "} \t\r\n"  # what may still be the call object's end


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str = ""  # with name, on a call's first piece only
    name: str = ""
    arguments: str = ""


@dataclass
class ToolSplit:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallSplit:
    def __init__(self, fmt: ToolFormat, use: ToolUse, request_id: str) -> None:
        self.fmt = fmt
        self.tools = use.for_template()
        self.request_id = request_id
        self.calls_made = 0
        self._held = ""  # outside a call: a tail that may become the start marker
        self._call: str | None = None  # inside a call: its text so far
        self._arguments_at = -1  # where the streamed arguments start in _call (-1: not yet)
        self._sent = 0  # characters of the arguments sent
        self._spacing = ""  # whitespace after a call, held (see _content)

    def add(self, text: str) -> ToolSplit:
        out = ToolSplit()
        rest = self._held + text
        self._held = ""
        while rest:
            if self._call is None:
                at = rest.find(self.fmt.start)
                if at == -1:
                    keep = open_prefix(rest, self.fmt.start)
                    self._content(out, rest[: len(rest) - keep])
                    self._held = rest[len(rest) - keep :]
                    return out
                self._content(out, rest[:at])
                self._spacing = ""  # between two calls: not content
                rest = rest[at + len(self.fmt.start) :]
                self._call, self._arguments_at, self._sent = "", -1, 0
                continue
            self._call += rest
            rest = ""
            at = self._call.find(self.fmt.end)
            if at == -1:
                keep = open_prefix(self._call, self.fmt.end)
                self._stream(out, self._call[: len(self._call) - keep])
                return out
            rest = self._call[at + len(self.fmt.end) :]
            self._close(out, self._call[:at], closed=True)
        return out

    def finish(self) -> ToolSplit:
        """The end of the generation: a held tail is content, an open call is closed."""
        out = ToolSplit()
        self._content(out, self._held)
        self._held = self._spacing = ""
        if self._call is not None:
            self._close(out, self._call, closed=False)
        return out

    def _content(self, out: ToolSplit, text: str) -> None:
        """Text outside calls; after a call, whitespace waits for text to go with (the
        newlines between and after calls are layout, not content)."""
        if self.calls_made and not (self._spacing + text).strip():
            self._spacing += text
            return
        out.content += self._spacing + text
        self._spacing = ""

    def _stream(self, out: ToolSplit, body: str) -> None:
        if not self.fmt.json_body:
            return
        if self._arguments_at < 0:
            match = NAME_THEN_ARGUMENTS.match(body)
            if match is None:
                return
            try:
                name = json.loads(match.group(1))
            except ValueError:  # a malformed escape: left to the parser, whole, at the end
                return
            self._arguments_at = match.end()
            out.calls.append(ToolCallDelta(self.calls_made, self._id(), name))
        arguments = body[self._arguments_at :].lstrip()
        ready = len(arguments.rstrip(CLOSING))
        if ready > self._sent:
            out.calls.append(
                ToolCallDelta(self.calls_made, arguments=arguments[self._sent : ready])
            )
            self._sent = ready

    def _close(self, out: ToolSplit, body: str, closed: bool) -> None:
        self._call = None
        self._stream(out, body)
        if self._arguments_at >= 0:  # streamed: the rest of its arguments
            arguments = body[self._arguments_at :].strip()
            if arguments.endswith("}"):
                arguments = arguments[:-1].rstrip()
            if len(arguments) > self._sent:
                out.calls.append(ToolCallDelta(self.calls_made, arguments=arguments[self._sent :]))
            self.calls_made += 1
            return
        parsed = self._parse(body)
        if parsed is None:
            out.content += self.fmt.start + body + (self.fmt.end if closed else "")
            return
        for name, arguments in parsed:
            out.calls.append(ToolCallDelta(self.calls_made, self._id(), name, arguments))
            self.calls_made += 1

    def _parse(self, body: str) -> list[tuple[str, str]] | None:
        """(name, arguments as JSON text) per call, by mlx-lm's parser; None: not a call."""
        try:
            parsed: Any = self.fmt.parse(body, self.tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            out = []
            for call in calls:
                arguments = call["arguments"]
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                out.append((str(call["name"]), arguments))
            return out
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            # The model's text only: what failed, not what it said (no prompts in logs).
            log.warning(
                "a tool call of %d characters did not parse: %s", len(body), type(exc).__name__
            )
            return None

    def _id(self) -> str:
        return call_id(self.request_id, self.calls_made)


def tool_call_split(use: ToolUse | None, tokenizer: Any, request_id: str) -> ToolCallSplit | None:
    """The split for a request, or None: no tools, or tool_choice none (nothing parsed)."""
    if use is None or use.mode is ChoiceMode.NONE:
        return None
    fmt = tool_format(tokenizer)
    return ToolCallSplit(fmt, use, request_id) if fmt is not None else None
