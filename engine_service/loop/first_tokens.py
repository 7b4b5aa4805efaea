"""A row's first token on its way as soon as it is sampled (the half of loop/scheduler.py's
`_step` between the batch's step and its reports), after the step that ran over a direct
store hit has confirmed the read (loop/read_confirmations.py).

mlx-lm reports a token from the `next()` that launches the step after it; on the CPU that
launch computes much of the step itself, so a first token waited a whole decode step
(docs/engine.md). A row whose first token ends it (a 1-token request, a stop token first)
ends its stream with it; the row leaves the batch, and its prefix is saved, a step later.

A mixin of `Scheduler`: the attributes and methods declared below are the scheduler's.
"""

from __future__ import annotations

import logging

from engine_service.checkpoints.manager import CheckpointManager
from engine_service.loop.jobs import Job
from engine_service.loop.read_confirmations import ReadConfirmations
from engine_service.loop.step_checkpoints import StepCheckpoints
from engine_service.model.folded_prefill import FirstToken, FoldingBatchGenerator
from engine_service.protocol.events import Event

log = logging.getLogger(__name__)


class FirstTokens:
    """First tokens sent ahead, and direct store reads confirmed before them (MLX thread)."""

    checkpoints: CheckpointManager | None
    _bg: FoldingBatchGenerator
    _rows: dict[int, Job]
    _by_id: dict[str, Job]
    _unconfirmed: ReadConfirmations
    _step_checkpoints: StepCheckpoints | None

    def emit(self, job: Job, events: list[Event]) -> None:
        raise NotImplementedError

    def _start_again(self, job: Job) -> None:
        raise NotImplementedError

    def _send_first_tokens(self, first_tokens: list[FirstToken]) -> None:
        """The first token of each row that began generating in this step leaves now, not
        with the next step's tokens (model/folded_prefill.py `first_tokens`): after its
        store read was confirmed (a row whose read was not is out of the batch by then)."""
        for first in first_tokens:
            job = self._rows.get(first.uid)
            if job is None:
                continue
            if job.at_first_new_token(sent_ahead=True):  # bench/hit_floor_bench.py reads it
                log.debug("first token phases, %s", job.first_token_phases())
            token = job.token_event(len(job.tokens), first.token, first.logprobs)
            # A token that ends the row (a 1-token request) ends its stream now too; the row
            # leaves the batch, and its prefix is saved, when the next step reports it.
            ending = job.ending_at(first.token)
            self.emit(job, [token, *([ending] if ending else [])])
            job.token_sent_ahead = first.token
            if self._step_checkpoints is not None and not job.tokens and not job.resumed:
                self._step_checkpoints.expect_prefix(job)  # saved once the step reports it

    def _confirm_reads(self, step_failed: bool = False) -> None:
        """Direct store hits used unconfirmed, after the step that ran over them and before
        any token of theirs leaves (loop/read_confirmations.py)."""
        if not self._unconfirmed:
            return
        ckpt = self.checkpoints
        assert ckpt is not None
        for outcome in self._unconfirmed.confirm_all(ckpt.prefixes, ckpt.counters, self._by_id):
            job = outcome.job
            if outcome.recompute:  # out of the batch (a failed step's is replaced whole)
                if job.uid in self._rows and not step_failed:
                    self._bg.remove([job.uid])
                self._rows.pop(job.uid, None)
                job.plan, job.restored_prefix = None, None
                self._start_again(job)
            if outcome.started is not None:
                self.emit(job, [outcome.started])
