"""Prefix affinity: requests that share a prompt prefix go to the engine that last served
it, so its in-memory prefix tier hits instead of the store or a prefill.

The prompt (token ids, text, or chat messages as one canonical string) is cut into blocks;
each block's hash chains the ones before it, so two prompts share a chain exactly as long as
their common prefix. The chain is scoped by the caller (its credential's digest) and the
namespace: routing never tells one tenant what another sent. Hand-written because no
library routes gRPC streams by prefix; the map is a bounded LRU.
"""

from __future__ import annotations

import collections
import hashlib

from tandem_wire.pb import engine_pb2

TOKEN_BLOCK = 16  # token ids a block (the engines' prefix block size)
TEXT_BLOCK = 64  # characters a block of a text or chat prompt
MAX_ENTRIES = 200_000


def prompt_chain(request: engine_pb2.GenerateRequest, scope: str) -> list[bytes]:
    """The block-hash chain of a request's prompt, whole blocks only."""
    if request.token_ids:
        ids = list(request.token_ids)
        blocks = [
            b",".join(str(t).encode() for t in ids[i : i + TOKEN_BLOCK])
            for i in range(0, len(ids) - TOKEN_BLOCK + 1, TOKEN_BLOCK)
        ]
    else:
        if request.messages:
            text = "".join(f"\x1e{m.role}\x1f{m.content}" for m in request.messages)
        else:
            text = request.text
        data = text.encode()
        blocks = [
            data[i : i + TEXT_BLOCK] for i in range(0, len(data) - TEXT_BLOCK + 1, TEXT_BLOCK)
        ]
    chain, h = [], hashlib.blake2b(f"{scope}\x00{request.namespace}".encode(), digest_size=16)
    for block in blocks:
        h.update(block)
        chain.append(h.copy().digest())
    return chain


class PrefixAffinity:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._owner: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._max = max_entries

    def preferred(self, chain: list[bytes]) -> list[str]:
        """Engines that served a prefix of this prompt, longest shared prefix first."""
        found: list[str] = []
        for key in reversed(chain):
            address = self._owner.get(key)
            if address is not None and address not in found:
                found.append(address)
        return found

    def served(self, chain: list[bytes], address: str) -> None:
        for key in chain:
            self._owner[key] = address
            self._owner.move_to_end(key)
        while len(self._owner) > self._max:
            self._owner.popitem(last=False)
