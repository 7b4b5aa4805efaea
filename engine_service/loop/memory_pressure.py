"""A batch step that ran the device out of memory: fewer rows at a time, not failed requests.

An allocation MLX cannot make (engine_service/device_memory.py says what counts) is the
batch's memory, not a row's fault, so it is not INTERNAL:

- MLX's buffer cache is emptied first: freed buffers it keeps hold device memory nobody uses
  (MLX-CUDA gives them back only past 80% of the device's memory by its own count, and
  memory outside that count, such as CUDA's own, can exhaust the device before it).
- Each row is tried alone (loop/row_isolation.py). A row that runs the device out of memory
  alone ends RESOURCE_EXHAUSTED, its checkpoint kept: this device cannot run it however
  few rows run beside it.
- When every row runs alone, they all start again by recompute (their clients see no
  difference: samplers are keyed by step), at most half as many at a time as failed
  together; the rest wait in the queue. The ceiling rises by a row every RELAX_STEPS steps
  without a failure and goes once it reaches --max-running (vLLM preempts by recompute in
  the same way when its KV blocks run out).
"""

from __future__ import annotations

from dataclasses import dataclass

RELAX_STEPS = 64  # batch steps without a failure before one more row may run


@dataclass
class RowCeiling:
    """How many rows may run while the device is short of memory (None: --max-running)."""

    rows: int | None = None
    calm_steps: int = 0  # steps since the last failure or rise

    def lower(self, failed_together: int) -> None:
        """After a batch of failed_together rows ran out of memory (each runs alone)."""
        self.rows = max(1, failed_together // 2)
        self.calm_steps = 0

    def stepped(self, max_running: int) -> None:
        """A batch step ran: the ceiling rises by a row every RELAX_STEPS of them."""
        if self.rows is None:
            return
        self.calm_steps += 1
        if self.calm_steps >= RELAX_STEPS:
            self.rows, self.calm_steps = self.rows + 1, 0
            if self.rows >= max_running:
                self.rows = None

    def limit(self, max_running: int) -> int:
        """The rows that may run now."""
        return max_running if self.rows is None else min(max_running, self.rows)
