"""MLX's cached buffers: when the engine loop has run nothing for a while they go back to the
device (a GPU may be shared). Not at once: a client's next turn, a moment later, would fault
all of its pages in again (~5 ms at 4k tokens). And on a GPU the cache is bounded: MLX keeps
freed buffers up to its whole memory limit (80% of an NVIDIA device's memory), but a batch
cache's planes regrow a step of columns at a time, and each regrow leaves buffers of a size
never asked for again. On an H100, 8 streams after 8,192-token prompts filled the device's
81 GB with them (and what CUDA holds outside MLX's count) until a step ran out of memory."""

from __future__ import annotations

import time

import mlx.core as mx

# How long the loop stays idle before MLX's cached buffers go back (mx.clear_cache).
IDLE_RELEASE_S = 1.0
# A GPU's cache holds at most this share of MLX's memory limit: ample for the buffers a step
# reuses (the same sizes every step), and room for CUDA's own beside the batch.
CACHE_SHARE = 0.25


def bound_cache() -> int:
    """On a GPU, MLX's buffer cache capped at CACHE_SHARE of its memory limit: the cap in
    bytes (0 on the CPU, where it is left as it is)."""
    if mx.default_device() != mx.gpu:
        return 0
    cap = int(mx.get_memory_limit() * CACHE_SHARE)
    mx.set_cache_limit(cap)
    return cap


class IdleBuffers:
    def __init__(self) -> None:
        self._since: float | None = 0.0  # 0: busy; None: the buffers went back since

    def tick(self, idle: bool) -> bool:
        """Called once per loop turn (MLX thread); True on the turn the loop became idle."""
        if not idle:
            self._since = 0.0
        elif self._since == 0.0:
            self._since = time.monotonic()
            return True
        elif self._since is not None and time.monotonic() - self._since >= IDLE_RELEASE_S:
            mx.clear_cache()
            self._since = None
        return False
