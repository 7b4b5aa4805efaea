"""Streaming text for one request: UTF-8-safe deltas and exact stop strings.

mlx-lm's streaming detokenizer turns tokens into text incrementally and holds back the
bytes of an unfinished multi-byte character. It also drops the leading space of the first
token it sees (right for a fresh document, wrong for a continuation), so it is primed with
the prompt's last token first. On top, any tail that could still become a stop string is
held back, and the text is cut exactly where a stop string begins.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt: Sequence[int] = ()) -> None:
        self._detok = tokenizer.detokenizer
        if prompt:
            self._detok.add_token(prompt[-1])
            self._detok.finalize()
            _ = self._detok.last_segment
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped_by = ""

    def add(self, token_id: int) -> str:
        """Feeds one generated token; returns the text that is now final ("" once stopped)."""
        if self.stopped_by:
            return ""
        self._detok.add_token(token_id)
        return self._release(self._detok.last_segment)

    def finish(self) -> str:
        """The text still held back, once the generation ended without a stop string."""
        if self.stopped_by:
            return ""
        self._detok.finalize()
        return self._release(self._detok.last_segment, final=True)

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
