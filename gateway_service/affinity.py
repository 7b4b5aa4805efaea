"""Prefix affinity: requests that share a prompt prefix go to the same engine, so its
in-memory prefix tier hits instead of the store or a prefill; every gateway picks the same
engine without asking the others.

The prompt (token ids, text, or chat messages as one canonical string) is cut into blocks,
and its first `AFFINITY_BLOCKS` whole blocks (fewer for a shorter prompt) are hashed in the
caller's scope (its credential's digest) and namespace: routing never tells one tenant what
another sent. The engine is chosen by rendezvous (highest-random-weight) hashing of that key
over the engines that can take the request: any gateway that sees the same healthy engines
ranks them the same, an engine that leaves moves only its own prefixes, and one that joins
takes only its share. The caller walks the ranking to the first engine within its load
slack (consistent hashing with bounded loads), so a hot prefix spills to its second engine,
the same one everywhere.
Hand-written because no library routes gRPC streams by prefix; it is a sort by a hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from tandem_wire.pb import engine_pb2

TOKEN_BLOCK = 16  # token ids a block (the engines' prefix block size)
TEXT_BLOCK = 64  # characters a block of a text or chat prompt
# The blocks that decide the engine: prompts that share their first 64 tokens (256 characters)
# go to the same one. Deeper would split a shared system prompt's turns by what follows it;
# shallower would pile unrelated prompts that merely start alike onto one engine.
AFFINITY_BLOCKS = 4


def affinity_key(request: engine_pb2.GenerateRequest, scope: str) -> bytes | None:
    """The hash of the prompt's first whole blocks (`AFFINITY_BLOCKS` at most) in the
    caller's scope and namespace; None for a prompt shorter than a block."""
    if request.token_ids:
        ids = list(request.token_ids[: TOKEN_BLOCK * AFFINITY_BLOCKS])
        blocks = [
            b",".join(str(t).encode() for t in ids[i : i + TOKEN_BLOCK])
            for i in range(0, len(ids) - TOKEN_BLOCK + 1, TOKEN_BLOCK)
        ]
    else:
        if request.messages:
            text = "".join(f"\x1e{m.role}\x1f{m.content}" for m in request.messages)
        else:
            text = request.text
        data = text.encode()[: TEXT_BLOCK * AFFINITY_BLOCKS]
        blocks = [
            data[i : i + TEXT_BLOCK] for i in range(0, len(data) - TEXT_BLOCK + 1, TEXT_BLOCK)
        ]
    if not blocks:
        return None
    h = hashlib.blake2b(f"{scope}\x00{request.namespace}".encode(), digest_size=16)
    for block in blocks:
        h.update(len(block).to_bytes(4, "little") + block)
    return h.digest()


def rendezvous_rank(key: bytes | None, addresses: Sequence[str]) -> list[str]:
    """The addresses in the order every gateway ranks them for this key; [] without a key
    (nothing to share: the least loaded engine takes the prompt)."""
    if key is None:
        return []
    return sorted(addresses, key=lambda a: _weight(key, a), reverse=True)


def _weight(key: bytes, address: str) -> bytes:
    return hashlib.blake2b(address.encode(), digest_size=8, key=key).digest()
