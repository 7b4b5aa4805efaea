"""What the engine loop does for checkpoints around each batch step (MLX thread).

After a row's token: the prompt's prefix is saved (first token), a pending generation
snapshot is queued now that its pending token is known, and the row is marked when its next
snapshot is due. After the step: the due rows are captured together (capture_due).
"""

from __future__ import annotations

import time
from typing import Any

from mlx_lm.generate import BatchGenerator

from engine_service.checkpoints import CheckpointManager
from engine_service.jobs import Job

# Generation snapshots are taken on steps that are multiples of this (see capture_due).
CHECKPOINT_ALIGN = 8


class StepCheckpoints:
    def __init__(self, checkpoints: CheckpointManager) -> None:
        self.checkpoints = checkpoints
        self._due: dict[int, Job] = {}  # rows whose generation checkpoint is due, by uid

    def after_token(self, job: Job, bg: BatchGenerator, finished_cache: list[Any] | None) -> None:
        """After a token: the prompt's prefix (first token), the generation every N tokens.

        A generation snapshot is taken when its N-th token is out, but only queued one step
        later: the token sampled in between is the checkpoint's pending token (sampled, not
        yet fed), known then without forcing the batch's look-ahead to finish early.
        """
        ckpt = self.checkpoints
        r = job.request
        if job.snapshot is not None:
            snapshot, job.snapshot = job.snapshot, None
            if finished_cache is None:  # a finishing job deletes its checkpoint anyway
                ckpt.generations.save(job, snapshot, pending=job.tokens[-1])
        if len(job.tokens) == 1 and not job.resumed:
            seconds = time.monotonic() - job.admitted_at
            ckpt.add_prefill_time(seconds)
            if job.plan is None:  # a whole prefill: the rate a store hit is weighed against
                ckpt.prefixes.cost.observe_prefill(len(r.prompt), seconds)
            row = finished_cache or _row_cache(bg, job)
            if row is not None:
                ckpt.prefixes.save(row, r.prompt, r.namespace, r.layout)
        if finished_cache is None and ckpt.generations.due(job):
            self._due[job.uid] = job

    def capture_due(self, bg: BatchGenerator, rows: dict[int, Job], step: int) -> None:
        """Snapshots every row whose checkpoint is due, together, on aligned steps.

        Extracting a row from mlx-lm's batch cache evaluates the batch's padding, a sync with
        the step in flight; rows captured one at a time paid it each (~11% of decode at 8
        streams every 16 tokens), rows captured together pay it once (~4%). A checkpoint is
        therefore up to CHECKPOINT_ALIGN - 1 tokens later than its interval.
        """
        if not self._due or step % CHECKPOINT_ALIGN:
            return
        jobs = [job for uid, job in self._due.items() if uid in rows]
        self._due = {}
        extracted = bg.extract_cache([job.uid for job in jobs])
        for job in jobs:
            found = extracted.get(job.uid)
            if found is not None:
                job.snapshot = self.checkpoints.generations.capture(job, found[0])


def _row_cache(bg: BatchGenerator, job: Job) -> list[Any] | None:
    found = bg.extract_cache([job.uid]).get(job.uid)
    return found[0] if found is not None else None
