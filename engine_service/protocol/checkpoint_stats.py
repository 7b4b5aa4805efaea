"""Checkpoint counters, shared by the prefix tier, generation checkpoints and the spill queue."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

# Upper bounds of the transfer-rate histograms, in GB/s: a remote store over a slow network
# sits at the left, a same-host region into device memory at the right.
GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


@dataclass
class RateHistogram:
    """Transfers by rate in GB/s, kept in the core and exported by the front as a Prometheus
    histogram (the core has no registry of its own: its numbers reach the front over the
    Stats call). counts[i] are the transfers in bucket i alone; the last is +Inf."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(GBPS_BUCKETS) + 1))
    sum_gbps: float = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        gbps = nbytes / seconds / 1e9
        index = next((i for i, le in enumerate(GBPS_BUCKETS) if gbps <= le), len(GBPS_BUCKETS))
        self.counts[index] += 1
        self.sum_gbps += gbps

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count at or below) pairs, +Inf last, as Prometheus wants them."""
        out, running = [], 0
        for le, count in zip([*map(str, GBPS_BUCKETS), "+Inf"], self.counts, strict=True):
            running += count
            out.append((le, running))
        return out


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
    # The restore-or-prefill choice (checkpoints/restore_cost.py): its two measured rates and
    # counts.
    restore_bytes_per_second: float = 0.0
    prefill_tokens_per_second: float = 0.0
    restore_chosen: int = 0
    prefill_chosen: int = 0
    # Store reads into caches (prefix hits and resumes) and checkpoint writes, by GB/s.
    restore_rate: RateHistogram = field(default_factory=RateHistogram)
    checkpoint_rate: RateHistogram = field(default_factory=RateHistogram)
    # Prompts that started with no reused prefix, by why (events.PrefixMissReason).
    misses_by_reason: dict[str, int] = field(default_factory=dict)
    # Store reads by how their bytes came (tandem_client.same_host.ReadRoute).
    reads_by_route: dict[str, int] = field(default_factory=dict)
    # The step loop's seconds on generation checkpoints (loop/step_checkpoints.py).
    capture_seconds: float = 0.0


class CheckpointCounters:
    """CheckpointStats behind a lock: the core's planning pool, the MLX thread and the spill thread
    all count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = CheckpointStats()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def miss(self, reason: str) -> None:
        with self._lock:
            by_reason = self._stats.misses_by_reason
            by_reason[reason] = by_reason.get(reason, 0) + 1

    def observe_restore(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._stats.restore_rate.observe(nbytes, seconds)

    def observe_checkpoint(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._stats.checkpoint_rate.observe(nbytes, seconds)

    def set_store_up(self, up: bool) -> None:
        with self._lock:
            self._stats.store_up = up

    def snapshot(self) -> CheckpointStats:
        with self._lock:
            return copy.deepcopy(self._stats)
