"""A reasoning model's chat answer split into its reasoning and its content.

Models that think (Qwen3, DeepSeek-R1, ...) write their reasoning between markers their
tokenizer knows (`<think>` ... `</think>`; mlx-lm's TokenizerWrapper finds them:
`think_start`, `think_end`), and their chat templates often open the reasoning themselves,
so the answer starts inside it. As mlx-lm's server does, a chat request starts in the
reasoning when its rendered prompt's last think marker is an opening one; the text is then
sent as `reasoning_text` until the closing marker, and as `text` after it (the markers
themselves in neither). A tail that could still become a marker is held back, as stop
strings are (front/text.py). Plain-text prompts are not split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningSplit:
    def __init__(self, start: str, end: str, reasoning: bool) -> None:
        self.start, self.end = start, end
        self.reasoning = reasoning  # inside the reasoning now
        self._held = ""

    def add(self, text: str) -> Split:
        """The text that is now final, by where it belongs."""
        out = Split()
        rest = self._held + text
        while True:
            marker = self.end if self.reasoning else self.start
            at = rest.find(marker)
            if at == -1:
                break
            self._put(out, rest[:at])
            rest = rest[at + len(marker) :]
            self.reasoning = not self.reasoning
        marker = self.end if self.reasoning else self.start
        keep = open_prefix(rest, marker)
        self._held = rest[len(rest) - keep :] if keep else ""
        self._put(out, rest[: len(rest) - keep])
        return out

    def finish(self) -> Split:
        """What is still held back, once the generation ended."""
        out = Split()
        self._put(out, self._held)
        self._held = ""
        return out

    def _put(self, out: Split, text: str) -> None:
        if self.reasoning:
            out.reasoning += text
        else:
            out.content += text


def reasoning_split(tokenizer: Any, prompt: Sequence[int], chat: bool) -> ReasoningSplit | None:
    """The split for a request, or None: not a chat, or a model with no think markers."""
    if not chat or not getattr(tokenizer, "has_thinking", False):
        return None
    start, end = tokenizer.think_start, tokenizer.think_end
    opened = tokenizer.rfind_think_start(list(prompt))
    closed = tokenizer.rfind_think_end(list(prompt))
    return ReasoningSplit(start, end, reasoning=opened > closed)


def open_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
