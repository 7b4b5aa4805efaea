"""Checkpoint counters, shared by the prefix tier, generation checkpoints and the spill queue."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass


@dataclass
class CheckpointStats:
    local_hits: int = 0
    store_hits: int = 0
    misses: int = 0
    restore_failures: int = 0
    restored_bytes: int = 0
    restore_seconds: float = 0.0
    prefill_seconds: float = 0.0
    saved: int = 0
    saved_bytes: int = 0
    dropped: int = 0
    failed: int = 0
    queued_bytes: int = 0
    resumes: int = 0
    store_up: bool = True
    shared_memory_reads: int = 0  # store reads through the same-host region
    # The restore-or-prefill choice (restore_cost.py): its two measured rates and counts.
    restore_bytes_per_second: float = 0.0
    prefill_tokens_per_second: float = 0.0
    restore_chosen: int = 0
    prefill_chosen: int = 0


class CheckpointCounters:
    """CheckpointStats behind a lock: handler threads, the MLX thread and the spill thread
    all count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = CheckpointStats()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def set_store_up(self, up: bool) -> None:
        with self._lock:
            self._stats.store_up = up

    def snapshot(self) -> CheckpointStats:
        with self._lock:
            return dataclasses.replace(self._stats)
