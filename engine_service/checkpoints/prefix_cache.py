"""The engine's in-memory tier of prefix reuse: captured caches by key, LRU, bounded in bytes.

Looked up by block-hash chain before the store is asked (docs/checkpoints.md). A trimmable
entry serves any block boundary up to its length; an exact one (caches that cannot be
trimmed: recurrent state, a wrapped window) only its own length, as the store indexes them.
"""

from __future__ import annotations

import collections
import threading

from engine_service.checkpoints.cache_records import CapturedCache

BLOCK_SIZE = 64


class PrefixCache:
    """Captured prefix caches by key, least recently used first, bounded in bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[bytes, tuple[CapturedCache, int]] = (
            collections.OrderedDict()
        )
        # block hash -> (key, length it serves, exact: that length only)
        self._chain: dict[bytes, tuple[bytes, int, bool]] = {}
        self._hashes: dict[bytes, list[bytes]] = {}
        self.nbytes = 0

    def add(
        self,
        key: bytes,
        captured: CapturedCache,
        chain: list[bytes],
        length: int,
        exact: bool = False,
    ) -> None:
        """Keeps a capture of `length` tokens whose block-hash chain is `chain`; exact: it
        serves that length only (indexed under its last block hash alone)."""
        if captured.nbytes > self.capacity:
            return
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            here = self._chain.get(chain[-1])
            if exact and here is not None and not here[2]:
                return  # a trimmable entry serves that length already, and shorter ones
            self._entries[key] = (captured, length)
            self.nbytes += captured.nbytes
            if exact:
                self._hashes[key] = [chain[-1]]
                self._chain[chain[-1]] = (key, length, True)
            else:
                self._hashes[key] = chain
                for i, h in enumerate(chain):
                    self._chain[h] = (key, min((i + 1) * BLOCK_SIZE, length), False)
            while self.nbytes > self.capacity:
                old, (cap, _) = self._entries.popitem(last=False)
                self.nbytes -= cap.nbytes
                for h in self._hashes.pop(old, []):
                    if self._chain.get(h, (b"",))[0] == old:
                        del self._chain[h]

    def match(self, chain: list[bytes], lengths: list[int]) -> tuple[bytes, int, bool]:
        """The longest entry serving `lengths[i]` tokens of a prompt whose chain is `chain`:
        (key, tokens served, exact), or (b"", 0, False)."""
        with self._lock:
            for h, n in zip(reversed(chain), reversed(lengths), strict=True):
                hit = self._chain.get(h)
                if hit is not None and (hit[1] == n if hit[2] else hit[1] >= n):
                    return hit[0], n, hit[2]
        return b"", 0, False

    def get(self, key: bytes) -> CapturedCache | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries
