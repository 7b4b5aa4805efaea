"""Prompt identity: block-hash chains and checkpoint keys, shared by the engine and clients.

h_0 is a digest of the scope (model identity, cache layout, namespace); h_i digests
h_{i-1} and the tokens of block i. Entry i therefore names the first
min((i + 1) * block_size, n) tokens and everything they were computed under, and two
prompts share entry i exactly when they share that prefix.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 64
DIGEST_BYTES = 32


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(struct.pack(">I", len(part)))
        h.update(part)
    return h.digest()


def scope_digest(model_id: str, layout: Sequence[str], namespace: str) -> bytes:
    return _digest(
        b"tandem.scope.v1", model_id.encode(), "|".join(layout).encode(), namespace.encode()
    )


def _tokens(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def block_hashes(tokens: Sequence[int], block_size: int, scope: bytes) -> list[bytes]:
    """The chain for `tokens`: one entry per block, the last one possibly partial."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    chain, prev = [], scope
    for start in range(0, len(tokens), block_size):
        prev = _digest(b"block", prev, _tokens(tokens[start : start + block_size]))
        chain.append(prev)
    return chain


def prefix_key(scope: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a prefix checkpoint: the scope and the exact tokens."""
    return _digest(b"tandem.prefix.v1", scope, _tokens(tokens))


def generation_key(
    scope: bytes, prompt: Sequence[int], options_digest: bytes, request_id: str
) -> bytes:
    """Key of a generation checkpoint: scope, prompt, sampling options and request id."""
    return _digest(
        b"tandem.generation.v1", scope, _tokens(prompt), options_digest, request_id.encode()
    )
