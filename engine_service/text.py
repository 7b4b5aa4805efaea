"""Streaming text for one request: UTF-8-safe deltas and exact stop strings.

Deltas come from the tokenizer's own `decode` over a short sliding window (the
prefix/read-offset scheme of text-generation-inference), so their concatenation is exactly
what `decode` gives for the prompt and generation together, minus the prompt. mlx-lm's
streaming detokenizers would be cheaper but drop the leading space of the first generated
token (right for a fresh document, wrong for a continuation). On top, any tail that could
still become a stop string is held back, and the text is cut exactly where one begins.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens kept as left context, so the first generated token decodes as a continuation.
_CONTEXT_TOKENS = 6


class IncrementalDecoder:
    def __init__(self, tokenizer: Any, prompt: Sequence[int]) -> None:
        self._decode = tokenizer.decode
        self._tokens = list(prompt[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._tokens)

    def add(self, token_id: int) -> str:
        self._tokens.append(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        # A trailing U+FFFD is a multi-byte character still missing bytes: wait for them.
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        # The tokens just released become the next window's left context.
        self._tokens = self._tokens[self._read :]
        self._prefix, self._read = 0, len(self._tokens)
        return str(after[len(before) :])


class TextStream:
    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt: Sequence[int] = ()) -> None:
        self._decoder = IncrementalDecoder(tokenizer, prompt)
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped_by = ""

    def add(self, token_id: int) -> str:
        """Feeds one generated token; returns the text that is now final ("" once stopped)."""
        if self.stopped_by:
            return ""
        return self._release(self._decoder.add(token_id))

    def finish(self) -> str:
        """The text still held back, once the generation ended without a stop string."""
        if self.stopped_by:
            return ""
        return self._release(self._decoder.finish(), final=True)

    def _release(self, new: str, final: bool = False) -> str:
        text = self._held + new
        if not self._stops:
            self._held = ""
            return text
        cut = -1
        for stop in self._stops:
            at = text.find(stop)
            if at != -1 and (cut == -1 or at < cut):
                cut, self.stopped_by = at, stop
        if cut != -1:
            self._held = ""
            return text[:cut]
        keep = 0 if final else self._open_prefix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _open_prefix(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[-n:]):
                    best = n
                    break
        return best
