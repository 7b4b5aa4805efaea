"""The engine's in-memory tier of prefix reuse: captured caches by key, LRU, bounded in bytes.

Looked up by block-hash chain before the store is asked (docs/checkpoints.md).
"""

from __future__ import annotations

import collections
import threading

from engine_service.cache_codec import CapturedCache

BLOCK_SIZE = 64


class PrefixCache:
    """Captured prefix caches by key, least recently used first, bounded in bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[bytes, tuple[CapturedCache, int]] = (
            collections.OrderedDict()
        )
        self._chain: dict[bytes, tuple[bytes, int]] = {}  # block hash -> (key, length)
        self._hashes: dict[bytes, list[bytes]] = {}
        self.nbytes = 0

    def add(self, key: bytes, captured: CapturedCache, chain: list[bytes], length: int) -> None:
        if captured.nbytes > self.capacity:
            return
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            self._entries[key] = (captured, length)
            self._hashes[key] = chain
            self.nbytes += captured.nbytes
            for i, h in enumerate(chain):
                self._chain[h] = (key, min((i + 1) * BLOCK_SIZE, length))
            while self.nbytes > self.capacity:
                old, (cap, _) = self._entries.popitem(last=False)
                self.nbytes -= cap.nbytes
                for h in self._hashes.pop(old, []):
                    if self._chain.get(h, (b"",))[0] == old:
                        del self._chain[h]

    def match(self, chain: list[bytes], lengths: list[int]) -> tuple[bytes, int]:
        with self._lock:
            for h, n in zip(reversed(chain), reversed(lengths), strict=True):
                hit = self._chain.get(h)
                if hit is not None and hit[1] >= n:
                    return hit[0], n
        return b"", 0

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
