"""When the engine loop has run nothing for a while, the buffers MLX cached for the batch go
back to the device (a GPU may be shared). Not at once: a client's next turn, a moment later,
would fault all of its pages in again (~5 ms at 4k tokens)."""

from __future__ import annotations

import time

import mlx.core as mx

# How long the loop stays idle before MLX's cached buffers go back (mx.clear_cache).
IDLE_RELEASE_S = 1.0


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
