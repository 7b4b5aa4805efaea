"""The engine's messages as a Responses API object and its event stream.

A response's output is a list of items: a `reasoning` item (a reasoning model's thinking), a
`message` item with one `output_text` part, and a `function_call` item per call, in the
order the model made them. Streamed, each item is announced (`response.output_item.added`),
grows by deltas (`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`) and is closed (`...done`,
`response.output_item.done`) before the next one opens; the stream opens with
`response.created` and `response.in_progress` and ends with `response.completed` (or
`response.incomplete` when max_output_tokens cut it), every event numbered
(`sequence_number`), as OpenAI sends them and its SDK parses them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tandem_wire.pb import engine_pb2


class ItemKind(Enum):
    REASONING = "reasoning"
    MESSAGE = "message"
    FUNCTION_CALL = "function_call"


@dataclass
class Item:
    kind: ItemKind
    id: str
    text: str = ""  # reasoning or message text, or a call's arguments
    call_id: str = ""
    name: str = ""
    done: bool = False

    def shape(self) -> dict[str, Any]:
        status = "completed" if self.done else "in_progress"
        if self.kind is ItemKind.MESSAGE:
            parts = [_text_part(self.text)] if self.done else []
            return {
                "type": "message",
                "id": self.id,
                "status": status,
                "role": "assistant",
                "content": parts,
            }
        if self.kind is ItemKind.REASONING:
            content = [{"type": "reasoning_text", "text": self.text}] if self.done else []
            return {"type": "reasoning", "id": self.id, "summary": [], "content": content}
        return {
            "type": "function_call",
            "id": self.id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.text if self.done else "",
            "status": status,
        }


@dataclass
class ResponseShaper:
    model: str
    echo: dict[str, Any]  # request fields a Response repeats (instructions, tools, ...)
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    created_at: int = field(default_factory=lambda: int(time.time()))
    items: list[Item] = field(default_factory=list)
    calls: dict[int, Item] = field(default_factory=dict)  # by the engine's call index
    sequence: int = 0
    usage: dict[str, Any] | None = None
    incomplete: bool = False
    finished: bool = False

    def opening(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def add(self, message: engine_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The events of one engine message (also kept for the final object)."""
        out: list[dict[str, Any]] = []
        if message.reasoning_text:
            item = self._open(ItemKind.REASONING, out)
            item.text += message.reasoning_text
            out.append(
                self._at("response.reasoning_text.delta", item, delta=message.reasoning_text)
            )
        if message.text:
            item = self._open(ItemKind.MESSAGE, out)
            item.text += message.text
            out.append(
                self._at("response.output_text.delta", item, delta=message.text, logprobs=[])
            )
        for d in message.tool_calls:
            call = self.calls.get(d.index)
            if call is None:
                call = self._open(ItemKind.FUNCTION_CALL, out, d.id, d.name)
                self.calls[d.index] = call
            if d.arguments:
                call.text += d.arguments
                out.append(
                    self._at("response.function_call_arguments.delta", call, delta=d.arguments)
                )
        if message.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
            self._close_open(out)
            self.finished = True
            self.incomplete = message.finish_reason == engine_pb2.FINISH_REASON_LENGTH
            u = message.usage
            self.usage = {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
                "output_tokens": u.generated_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.generated_tokens,
            }
            kind = "response.incomplete" if self.incomplete else "response.completed"
            out.append(self._event(kind, response=self.response()))
        return out

    def response(self) -> dict[str, Any]:
        """The Response object as it stands."""
        if not self.finished:
            status = "in_progress"
        else:
            status = "incomplete" if self.incomplete else "completed"
        details = {"reason": "max_output_tokens"} if self.incomplete else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": details,
            "model": self.model,
            "output": [i.shape() for i in self.items],
            "usage": self.usage,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "store": False,
            "metadata": {},
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            **self.echo,
        }

    def assistant_message(self) -> dict[str, Any]:
        """The answer as a chat history message (conversations.py): its text and calls."""
        text = "".join(i.text for i in self.items if i.kind is ItemKind.MESSAGE)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [i for i in self.items if i.kind is ItemKind.FUNCTION_CALL]
        if calls:
            message["tool_calls"] = [
                {
                    "id": c.call_id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.text},
                }
                for c in calls
            ]
        return message

    def _open(
        self, kind: ItemKind, out: list[dict[str, Any]], call_id: str = "", name: str = ""
    ) -> Item:
        """The open item of this kind, or a new one (the one open before it closed)."""
        last = self.items[-1] if self.items else None
        if (
            last is not None
            and last.kind is kind
            and not last.done
            and kind is not ItemKind.FUNCTION_CALL
        ):
            return last
        self._close_open(out)
        prefix = {
            ItemKind.MESSAGE: "msg_",
            ItemKind.REASONING: "rs_",
            ItemKind.FUNCTION_CALL: "fc_",
        }
        item = Item(kind, prefix[kind] + uuid.uuid4().hex, call_id=call_id, name=name)
        self.items.append(item)
        out.append(
            self._event(
                "response.output_item.added", output_index=len(self.items) - 1, item=item.shape()
            )
        )
        if kind is ItemKind.MESSAGE:
            out.append(self._at("response.content_part.added", item, part=_text_part("")))
        return item

    def _close_open(self, out: list[dict[str, Any]]) -> None:
        for index, item in enumerate(self.items):
            if item.done:
                continue
            item.done = True
            if item.kind is ItemKind.MESSAGE:
                out.append(self._at("response.output_text.done", item, text=item.text, logprobs=[]))
                out.append(self._at("response.content_part.done", item, part=_text_part(item.text)))
            elif item.kind is ItemKind.REASONING:
                out.append(self._at("response.reasoning_text.done", item, text=item.text))
            else:
                done = "response.function_call_arguments.done"
                out.append(self._at(done, item, arguments=item.text, name=item.name))
            out.append(
                self._event("response.output_item.done", output_index=index, item=item.shape())
            )

    def _at(self, kind: str, item: Item, **fields: Any) -> dict[str, Any]:
        where: dict[str, Any] = {"item_id": item.id, "output_index": self.items.index(item)}
        if item.kind is not ItemKind.FUNCTION_CALL:
            where["content_index"] = 0
        return self._event(kind, **where, **fields)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
