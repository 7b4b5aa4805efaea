"""The engine's messages as OpenAI's response objects: streamed chunks in the order OpenAI
sends them, and the final object of a request that does not stream.

A chat stream is: a chunk with the role alone (`{"role": "assistant", "content": ""}`), the
content chunks, a chunk with an empty delta and the finish reason, the usage chunk (no
choices) when asked for, then `[DONE]`. A completion stream has no role chunk; its last
chunk holds empty text and the finish reason. SDKs and OpenAI's own clients parse the
stream in that shape (llama.cpp's server tests check it).

Every chunk also carries `tandem: {request_id, tokens_held}`: what a client whose gateway
died sends another one to resume (docs/gateway.md). A message whose tokens have no text
yet still gets its chunk, so `tokens_held` never lags the text the client holds.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway_service.openai_tools import ToolCalls
from tandem_wire.pb import engine_pb2

FINISH = {
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_CANCELLED: "stop",
}


@dataclass
class Shaper:
    """One response's OpenAI objects, built as the engine's messages arrive."""

    chat: bool
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    request_id: str = ""
    tokens_held: int = 0
    text: str = ""
    reasoning: str = ""  # a reasoning model's thinking: `reasoning_content`
    tool_calls: ToolCalls = field(default_factory=ToolCalls)
    logprobs: list[engine_pb2.TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    index: int = 0  # which choice (n > 1: gateway_service/openai_choices.py)
    echo: str = ""  # a completion's prompt, given back before its text (`echo`)
    opened: bool = False
    offset: int = 0  # characters of completion text before the next token (text_offset)
    _tool_deltas: list[dict[str, Any]] = field(default_factory=list)  # the last message's

    def __post_init__(self) -> None:
        self.offset = len(self.echo)

    @property
    def object_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    @property
    def kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def add(self, message: engine_pb2.GenerateResponse) -> None:
        self.text += message.text
        self.reasoning += message.reasoning_text
        self.tokens_held += len(message.token_ids)
        self.logprobs.extend(message.logprobs)
        self._tool_deltas = self.tool_calls.add(message.tool_calls)
        if message.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
            self.finish = FINISH.get(message.finish_reason, "stop")
            if self.finish == "stop" and self.tool_calls:
                self.finish = "tool_calls"  # OpenAI's name for an answer that made calls
            u = message.usage
            self.usage = {
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.generated_tokens,
                "total_tokens": u.prompt_tokens + u.generated_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
                "failovers": u.failovers,
            }

    def chunks(self, message: engine_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The chunks for one engine message, after `add(message)`."""
        out = []
        if self.chat and not self.opened:
            out.append(self._chunk({"delta": {"role": "assistant", "content": ""}}))
        elif self.echo and not self.opened:
            out.append(self._chunk({"text": self.echo}))
        self.opened = True
        if message.text or message.token_ids or message.reasoning_text or self._tool_deltas:
            if self.chat:
                logprobs = _chat_logprobs(message.logprobs)
                delta: dict[str, Any] = {"content": message.text}
                if message.reasoning_text or self._tool_deltas:
                    delta = {"content": message.text} if message.text else {}
                if message.reasoning_text:  # DeepSeek's and vLLM's name for it
                    delta["reasoning_content"] = message.reasoning_text
                if self._tool_deltas:
                    delta["tool_calls"] = self._tool_deltas
                out.append(self._chunk({"delta": delta, "logprobs": logprobs}))
            else:
                logprobs = self._completion_logprobs(message.logprobs)
                out.append(self._chunk({"text": message.text, "logprobs": logprobs}))
        if message.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
            last: dict[str, Any] = {"delta": {}} if self.chat else {"text": ""}
            out.append(self._chunk({**last, "finish_reason": self.finish}))
        return out

    def usage_chunk(self, usage: dict[str, Any] | None) -> dict[str, Any]:
        return self._envelope(self.kind, [], usage=usage)

    def final(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """The whole response of a request that did not stream, from each choice's
        `final_choice()`."""
        return self._envelope(
            "chat.completion" if self.chat else "text_completion", choices, usage=usage
        )

    def final_choice(self) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": self.text}
            if self.reasoning:
                message["reasoning_content"] = self.reasoning
            if self.tool_calls:
                message["tool_calls"] = self.tool_calls.whole()
                message["content"] = self.text or None  # as OpenAI sends a call alone
            return {
                "index": self.index,
                "message": message,
                "finish_reason": self.finish,
                "logprobs": _chat_logprobs(self.logprobs),
            }
        self.offset = len(self.echo)
        return {
            "index": self.index,
            "text": self.echo + self.text,
            "finish_reason": self.finish,
            "logprobs": self._completion_logprobs(self.logprobs),
        }

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        whole = {"index": self.index, "logprobs": None, "finish_reason": None, **choice}
        resume = {"request_id": self.request_id, "tokens_held": self.tokens_held}
        return self._envelope(self.kind, [whole], tandem=resume)

    def _envelope(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.object_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _completion_logprobs(self, lps: Any) -> dict[str, Any] | None:
        if not lps:
            return None
        offsets = []
        for lp in lps:  # where each token's text starts in the completion's text
            offsets.append(self.offset)
            self.offset += len(lp.text)
        return {
            "tokens": [lp.text for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t.text: t.logprob for t in lp.top} for lp in lps],
            "text_offset": offsets,
        }


def _chat_logprobs(lps: Any) -> dict[str, Any] | None:
    if not lps:
        return None
    content = []
    for lp in lps:
        top = [
            {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())} for t in lp.top
        ]
        content.append(
            {
                "token": lp.text,
                "logprob": lp.logprob,
                "bytes": list(lp.text.encode()),
                "top_logprobs": top,
            }
        )
    return {"content": content}
