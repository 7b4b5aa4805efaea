"""Structured output's masks for the whole batch at once.

mlx-lm's BatchGenerator takes logits processors per row, and once any row has one it slices
every row's logits out, runs the row's processors and concatenates the rows again: on an
H200 that path, not the grammar, was most of what constraints cost (32 of 32 rows
constrained decoded at 0.55 of plain). So a constrained row's processor runs only for the
row's first step (a new batch of the new rows, which mlx-lm steps before merging it); then
`settle` takes it out of mlx-lm's per-row list, and BatchMasks, the model the BatchGenerator
calls, masks the main batch's logits itself:

- the step's fed tokens (sampled a step before) are read once, and each constrained row's
  matcher consumes its own;
- llguidance's LLExecutor computes every constrained row's mask in parallel, in a worker
  thread (llguidance releases the GIL) while this thread builds and queues the forward pass:
  on an H200 the engine's step is bound by that host work (~13 ms for a 0.6B model at 32
  rows), so the masks cost nothing beside it;
- one bitmask for the batch goes to the device and one `where` applies it (unconstrained
  rows' logits pass through unchanged).

Reading the fed tokens before queuing the forward pass is right only while the device keeps
up with the host: when the device is the bound, it would idle while the host builds the
step. StepOrder watches how long that read waits and, once it waits, queues the forward
first and makes the masks after (they then overlap the device's step instead).

It reads mlx-lm's GenerationBatch (`_generation_batch`: `uids`, `prompt_cache`,
`logits_processors`; mlx-lm is pinned): where that is not there, rows keep their per-row
processors, which still mask every step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine_service.sampling.constraints import ConstrainedRow, apply_bitmask, mask_words

log = logging.getLogger(__name__)


@dataclass
class StepOrder:
    """Whether a constrained step reads its fed tokens before queuing the forward pass (the
    host is the bound: masks overlap the host's graph building) or after (the device is:
    masks overlap the device's step)."""

    wait_threshold_s: float = 0.001  # a read that waits this long: the device is behind
    retry_after: int = 512  # steps queued first before reading first is tried again
    read_first: bool = True
    read_first_steps: int = 0
    queued_first_steps: int = 0
    _wait: float = 0.0  # moving average of the read's wait
    _samples: int = 0
    _countdown: int = 0

    def waited(self, seconds: float) -> None:
        self.read_first_steps += 1
        self._wait = seconds if self._samples == 0 else 0.8 * self._wait + 0.2 * seconds
        self._samples += 1
        if self._samples >= 4 and self._wait > self.wait_threshold_s:
            self.read_first, self._countdown = False, self.retry_after
            log.info(
                "constrained steps queue the forward pass first for %d steps: reading the fed "
                "tokens waited %.2f ms (the device is behind)",
                self.retry_after,
                self._wait * 1e3,
            )

    def queued_first(self) -> None:
        self.queued_first_steps += 1
        self._countdown -= 1
        if self._countdown <= 0:
            self.read_first, self._samples = True, 0


class BatchMasks:
    """The batch's model with the constrained rows' masks applied to its decode logits."""

    def __init__(self, model: Any, vocab_size: int, main_batch: Callable[[], Any]) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self._main_batch = main_batch  # the BatchGenerator's GenerationBatch, read each step
        self._pending: dict[int, ConstrainedRow] = {}  # inserted, first step not yet adopted
        self._rows: dict[int, ConstrainedRow] = {}  # masked here, by batch uid
        self._executor: Any = None  # llguidance's thread pool, made on the first mask
        self._worker: ThreadPoolExecutor | None = None  # makes the masks beside this thread
        self.order = StepOrder()
        self.batch_steps = 0  # steps masked here (for tests and stats)

    def __getattr__(self, name: str) -> Any:  # layers, make_cache, args...: the model's
        return getattr(self.model, name)

    def add(self, row: ConstrainedRow) -> None:
        """A row just inserted (its uid set); its first step is its own processor's."""
        self._pending[row.uid] = row

    def settle(self, live: Container[int]) -> None:
        """After a batch step: rows whose first step ran leave mlx-lm's per-row processors
        for the batch masks; rows no longer live (ended, cancelled, parked) are forgotten."""
        if not self._pending and not self._rows:
            return
        self._rows = {uid: row for uid, row in self._rows.items() if uid in live}
        self._pending = {uid: row for uid, row in self._pending.items() if uid in live}
        if not self._pending:
            return
        try:
            batch = self._main_batch()
            uids, processors = batch.uids, batch.logits_processors
        except AttributeError:  # another mlx-lm: the rows keep their processors
            return
        for i, uid in enumerate(uids):
            row = self._pending.get(uid)
            if row is None or not row.first_step_done:
                continue
            processors[i] = tuple(p for p in processors[i] if p is not row)
            self._rows[uid] = self._pending.pop(uid)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> Any:
        at = self._constrained(inputs, cache)
        if not at:
            return self.model(inputs, cache=cache, **kwargs)
        rows = inputs.shape[0]
        if self.order.read_first:
            start = time.perf_counter()
            self._advance(inputs, at)  # waits for the tokens sampled a step ago
            self.order.waited(time.perf_counter() - start)
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="constraint-masks")
            masks = self._worker.submit(self._masks, rows, at)
            logits = self.model(inputs, cache=cache, **kwargs)
            mx.async_eval(logits)
            bitmask = masks.result()
        else:
            logits = self.model(inputs, cache=cache, **kwargs)
            mx.async_eval(logits)  # the device computes the step while the masks are made
            self._advance(inputs, at)
            bitmask = self._masks(rows, at)
            self.order.queued_first()
        return apply_bitmask(logits, bitmask, self._masked(rows, at))

    def _constrained(self, inputs: mx.array, cache: Any) -> list[tuple[int, ConstrainedRow]]:
        """The main batch's constrained rows, by batch index, when this is its decode step."""
        if not self._rows or inputs.ndim != 2 or inputs.shape[1] != 1:
            return []
        try:
            batch = self._main_batch()
            if cache is not batch.prompt_cache:  # a prefill, or new rows' first step
                return []
            uids = batch.uids
        except AttributeError:
            return []
        return [(i, self._rows[uid]) for i, uid in enumerate(uids) if uid in self._rows]

    @staticmethod
    def _advance(inputs: mx.array, at: list[tuple[int, ConstrainedRow]]) -> None:
        fed: list[Any] = inputs[:, 0].tolist()  # type: ignore[assignment]
        for i, row in at:
            row.advance(int(fed[i]))

    def _masks(self, rows: int, at: list[tuple[int, ConstrainedRow]]) -> np.ndarray[Any, Any]:
        from llguidance import LLExecutor

        if self._executor is None:
            self._executor = LLExecutor()
        words = mask_words(self.vocab_size)
        bitmask = np.full((rows, words), -1, dtype=np.int32)  # unconstrained rows: all allowed
        self._executor.unsafe_compute_mask_ptr(
            [(row.matcher, i) for i, row in at], bitmask.ctypes.data, words * 4, rows
        )
        self.batch_steps += 1
        return bitmask

    @staticmethod
    def _masked(rows: int, at: list[tuple[int, ConstrainedRow]]) -> np.ndarray[Any, Any]:
        masked = np.zeros((rows,), dtype=bool)
        masked[[i for i, _ in at]] = True
        return masked
