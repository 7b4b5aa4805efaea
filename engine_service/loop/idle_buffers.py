"""When the engine loop has run nothing for a while, the buffers MLX cached for the batch go
back to the device (a GPU may be shared). Not at once: a client's next turn, a moment later,
would fault all of its pages in again (~5 ms at 4k tokens). On MLX-CUDA the device pool's
kept memory goes back with them (engine_service/cuda_runtime.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

# How long the loop stays idle before MLX's cached buffers go back (mx.clear_cache).
IDLE_RELEASE_S = 1.0
# And before the device pool's kept memory goes back to the driver: much later, since a
# request after it maps every page again (the H200's 32k hit spent 66 ms in cudaMallocAsync).
POOL_RELEASE_S = 300.0


class IdleBuffers:
    def __init__(self, release_more: Callable[[], None] | None = None) -> None:
        self._since: float | None = 0.0  # 0: busy; None: the buffers went back since
        self._release_more = release_more  # after MLX's: the device pool's trim
        self._cleared = False

    def tick(self, idle: bool) -> bool:
        """Called once per loop turn (MLX thread); True on the turn the loop became idle."""
        if not idle:
            self._since = 0.0
            self._cleared = False
        elif self._since == 0.0:
            self._since = time.monotonic()
            return True
        elif self._since is not None and time.monotonic() - self._since >= IDLE_RELEASE_S:
            if not self._cleared:
                mx.clear_cache()
                self._cleared = True
            if time.monotonic() - self._since >= POOL_RELEASE_S:
                if self._release_more is not None:
                    self._release_more()
                self._since = None
        return False
