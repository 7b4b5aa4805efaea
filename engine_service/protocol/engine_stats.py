"""The engine loop's counters (Stats RPC), kept by the scheduler under its lock."""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field

# Decode rate: tokens over the last this many seconds.
RATE_WINDOW_S = 5.0


@dataclass
class ParkCounters:
    preempted_total: int = 0
    unparked_total: int = 0
    idle_cancelled_total: int = 0
    over_budget_total: int = 0  # asked to park, kept running: the budget was full
    parked_to_store_total: int = 0  # parked in the store only, memory freed
    parked: int = 0
    parked_bytes: int = 0
    turns_yielded_total: int = 0  # slots given up to waiting requests (queued again)
    capture_failed_total: int = 0  # asked to leave, kept running: capturing the row raised


@dataclass
class SpeculativeCounters:
    """The speculative batch's rounds, proposals and rollbacks since start."""

    rounds_total: int = 0
    drafted_total: int = 0
    accepted_total: int = 0
    rollbacks_total: int = 0


@dataclass
class EngineStats:
    running: int = 0
    queued: int = 0
    requests_total: int = 0
    generated_tokens_total: int = 0
    prompt_tokens_total: int = 0
    decode_tokens_per_second: float = 0.0
    batch_size: int = 0
    max_batch_size_seen: int = 0
    mean_batch_size: float = 0.0
    cancelled_total: int = 0
    rejected_total: int = 0
    steps_total: int = 0
    # Rows ended because the model failed on them alone (loop/row_isolation.py).
    isolated_failures_total: int = 0
    # Steps that ran the device out of memory, and the rows that may run now (0: no ceiling):
    # loop/memory_pressure.py.
    out_of_memory_steps_total: int = 0
    row_ceiling: int = 0
    parking: ParkCounters = field(default_factory=ParkCounters)
    # Bytes the running batch's KV caches hold (read every few steps; 0 when idle).
    kv_cache_bytes: int = 0
    speculative: SpeculativeCounters = field(default_factory=SpeculativeCounters)
    # (time.monotonic(), tokens) of recent steps, for the decode rate.
    recent: collections.deque[tuple[float, int]] = field(
        default_factory=lambda: collections.deque(maxlen=256)
    )

    def add_step(self, rows: int, now: float) -> None:
        """One batch step that produced a token for each of `rows` rows."""
        self.steps_total += 1
        self.batch_size = rows
        self.max_batch_size_seen = max(self.max_batch_size_seen, rows)
        self.add_tokens(rows, now)

    def add_tokens(self, tokens: int, now: float) -> None:
        self.generated_tokens_total += tokens
        self.recent.append((now, tokens))

    def snapshot(self, now: float) -> EngineStats:
        """A copy with the derived rates filled in."""
        window = [(t, n) for t, n in self.recent if now - t <= RATE_WINDOW_S]
        tps = 0.0
        if len(window) >= 2:
            span = window[-1][0] - window[0][0]
            tps = sum(n for _, n in window[1:]) / span if span > 0 else 0.0
        return EngineStats(
            running=self.running,
            queued=self.queued,
            requests_total=self.requests_total,
            generated_tokens_total=self.generated_tokens_total,
            prompt_tokens_total=self.prompt_tokens_total,
            decode_tokens_per_second=tps,
            batch_size=self.batch_size,
            max_batch_size_seen=self.max_batch_size_seen,
            mean_batch_size=(
                self.generated_tokens_total / self.steps_total if self.steps_total else 0
            ),
            cancelled_total=self.cancelled_total,
            rejected_total=self.rejected_total,
            steps_total=self.steps_total,
            isolated_failures_total=self.isolated_failures_total,
            out_of_memory_steps_total=self.out_of_memory_steps_total,
            row_ceiling=self.row_ceiling,
            parking=dataclasses.replace(self.parking),
            kv_cache_bytes=self.kv_cache_bytes,
            speculative=dataclasses.replace(self.speculative),
        )
