"""The tokens of a checkpoint chain's later segments: each carries only the tokens of the
positions it holds, and a digest of every token before them.

A later segment (one past its chain's first) says itself the generation's state when it was
taken (checkpoints/generation_loads.py reads the chain on from the manifest). It used to carry
that as the whole token list, prompt included: with an 8,192-token prompt a round of 8 rows
built, encoded and stored 8 lists of ~9k tokens every 16 tokens (~1.7 ms of the engine's
threads on 2 CPU cores, and the store's), for 16 new tokens a row. Now its `token_ids` are
those of positions [start, end), and its metadata's TOKENS_BEFORE the digest of the tokens of
positions [0, start): a resume rebuilds the list segment by segment and still refuses a
segment of another run (one whose tokens before it differ) as before.

Segments written before this change carry the whole list and no TOKENS_BEFORE; a chain may
mix both (an engine upgraded mid-generation). An engine that predates it sees a later segment
of this kind as not continuing the chain, and resumes from the segment before it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# A later segment's metadata key: TokenDigest.hexdigest() of every token before its start.
TOKENS_BEFORE = "tokens_before"


@dataclass
class TokenDigest:
    """A running digest of a generation's tokens from position 0, fed as they grow (each
    token as 8 little-endian bytes): a digest of n tokens costs the tokens added since the
    last one, not n."""

    count: int = 0  # tokens fed so far
    _hash: hashlib.blake2b = field(default_factory=lambda: hashlib.blake2b(digest_size=16))

    def feed(self, tokens: Sequence[int]) -> None:
        if tokens:
            self._hash.update(np.asarray(tokens, dtype="<i8").tobytes())
            self.count += len(tokens)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def reset(self) -> None:
        self.count, self._hash = 0, hashlib.blake2b(digest_size=16)


def tokens_between(prompt: Sequence[int], generated: Sequence[int], a: int, b: int) -> list[int]:
    """Tokens of positions [a, b) of prompt + generated, without building the whole list."""
    p = len(prompt)
    return [*prompt[min(a, p) : min(b, p)], *generated[max(a - p, 0) : max(b - p, 0)]]


def digest_before(
    digest: TokenDigest, prompt: Sequence[int], generated: Sequence[int], start: int
) -> str:
    """The digest of the tokens of positions [0, start), `digest` fed on to there (a
    generation's chain keeps one, ChainCursor.tokens; a resume's walk along a chain
    another). A digest past `start` (its chain started over) is fed again from 0."""
    if digest.count > start:
        digest.reset()
    digest.feed(tokens_between(prompt, generated, digest.count, start))
    return digest.hexdigest()


def continued(
    tokens: list[int],
    digest: TokenDigest,
    start: int,
    segment_tokens: Sequence[int],
    metadata: dict[str, str],
) -> list[int] | None:
    """The generation's tokens after a later segment that starts at `start`, from `tokens`
    (those before it); None when the segment does not continue them: it starts elsewhere, or
    it is another run's (other tokens before it). `digest`: the one a chain walk feeds as its
    tokens grow (digest_before)."""
    if start != len(tokens):
        return None
    before = metadata.get(TOKENS_BEFORE)
    if before is None:  # an older engine's segment: the whole list
        if list(segment_tokens[: len(tokens)]) != tokens:
            return None
        return list(segment_tokens)
    if digest_before(digest, tokens, (), start) != before:
        return None
    return [*tokens, *segment_tokens]
