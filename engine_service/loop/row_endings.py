"""How rows end outside a normal finish (loop/scheduler.py's other half of `_step`): cancelled,
past their deadline or idle, failed, or started again after a failed batch step.

A mixin of `Scheduler`: the attributes and methods declared below are the scheduler's.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import mlx.core as mx

from engine_service.device_memory import cache_given_back, is_out_of_memory
from engine_service.errors import EngineError, ModelFailed, Overloaded
from engine_service.loop.jobs import Job
from engine_service.loop.limits import Limits
from engine_service.loop.memory_pressure import RowCeiling
from engine_service.loop.parking import Parking
from engine_service.loop.preemption import Preemption
from engine_service.loop.row_isolation import isolate
from engine_service.loop.step_checkpoints import StepCheckpoints, first_snapshot_due
from engine_service.model.folded_prefill import FoldingBatchGenerator
from engine_service.model.loaded import LoadedModel
from engine_service.protocol.engine_stats import EngineStats
from engine_service.protocol.events import Event, Finished, FinishReason
from engine_service.sampling.masks import BatchMasks
from engine_service.speculative.lane import SpeculativeLane

log = logging.getLogger(__name__)


class RowEndings:
    """Cancellation, deadlines, idle clients, failures and isolation (MLX thread)."""

    loaded: LoadedModel
    limits: Limits
    _bg: FoldingBatchGenerator
    _rows: dict[int, Job]
    _by_id: dict[str, Job]
    _waiting: collections.deque[Job]
    _speculative: SpeculativeLane | None
    _preemption: Preemption
    _parking: Parking
    _masks: BatchMasks
    _ceiling: RowCeiling  # fewer rows at a time after the device ran out of memory
    _step_checkpoints: StepCheckpoints | None
    _cancels_due: set[str]  # request ids to cancel once their first token is reported
    _lock: threading.Lock
    _stats: EngineStats

    def finish(self, job: Job) -> None:
        raise NotImplementedError

    def emit(self, job: Job, events: list[Event]) -> None:
        raise NotImplementedError

    def _new_batch_generator(self) -> FoldingBatchGenerator:
        raise NotImplementedError

    def _start_again(self, job: Job) -> None:
        """Back to the front of the queue, to start again from its tokens (recompute)."""
        job.uid, job.recompute = -1, True
        self._waiting.appendleft(job)

    def _expire_idle(self) -> None:
        timeout = self.limits.park.idle_timeout_s
        for request_id in self._parking.idle_expired(time.monotonic()):
            self._cancel(request_id, "idle", f"the client read nothing for {timeout:g} s")

    def _cancel_keeping(self, request_id: str) -> None:
        """A Cancel: now, or, for a row whose checkpoint is kept (its client went away) and
        whose first token went ahead of the step that reports it, once that step ran. Its
        first snapshot is taken after that report (step_checkpoints.save_prefixes): a row
        removed before it left nothing to resume, so a client gone at its first token had to
        start again (tests/test_engine_zoo_processes.py raced so under load)."""
        job = self._by_id.get(request_id)
        if (
            job is not None
            and job.keep_checkpoint
            and job.uid >= 0
            and job.token_sent_ahead is not None
            and first_snapshot_due(job)
        ):
            self._cancels_due.add(request_id)
            return
        self._cancel(request_id)

    def _end_cancels_due(self) -> None:
        """The cancels _cancel_keeping put off whose rows' first tokens were reported (after
        the step's prefix saves)."""
        for request_id in list(self._cancels_due):
            job = self._by_id.get(request_id)
            if job is None or job.token_sent_ahead is None:
                self._cancels_due.discard(request_id)
                self._cancel(request_id)  # none: it finished meanwhile

    def _cancel(self, request_id: str, reason: FinishReason = "cancelled", error: str = "") -> None:
        job = self._by_id.get(request_id)
        if job is None:
            return
        if job.uid >= 0:
            self._bg.remove([job.uid])
        elif self._speculative is not None and request_id in self._speculative:
            self._speculative.remove(request_id)
        elif not self._preemption.is_parked(job):
            self._waiting.remove(job)
        self.finish(job)
        with self._lock:
            self._stats.cancelled_total += 1
        self.emit(job, [Finished(reason, error=error)])

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for job in list(self._by_id.values()):
            if job.request.deadline is not None and now > job.request.deadline:
                job.keep_checkpoint = True  # the client may retry with resume
                self._cancel(job.request.request_id, "deadline", "deadline exceeded")

    def _isolate(self, failure: Exception) -> None:
        """After a failed step (loop/row_isolation.py): the rows the model fails on alone end,
        the others wait at the front of the queue to start again by recompute. A step that ran
        the device out of memory is the batch's (loop/memory_pressure.py): MLX's cached
        buffers go back first, and rows that each run alone start again fewer at a time."""
        crowded = is_out_of_memory(failure)
        if crowded:
            with self._lock:
                self._stats.out_of_memory_steps_total += 1
            log.warning(
                "the device ran out of memory (MLX: %d MiB in use, %d MiB cached); emptying"
                " the cache and trying each row alone",
                mx.get_active_memory() >> 20,
                mx.get_cache_memory() >> 20,
            )
        jobs = list(self._rows.values())
        for job in [job for job in jobs if job.stream_ended]:  # its client has all of it
            self.finish(job)
        jobs = [job for job in jobs if not job.stream_ended]
        for job in jobs:  # a token its client has is kept: the row goes on after it
            if job.token_sent_ahead is not None:
                job.tokens.append(job.token_sent_ahead)
                job.token_sent_ahead = None
                if self._step_checkpoints is not None:
                    self._step_checkpoints.forget(job)
        self._rows.clear()
        self._bg = self._new_batch_generator()
        self._masks.settle(self._rows)
        cache_given_back(failure)  # the failed batch's buffers, now freed, and any kept before
        verdicts = isolate(self.loaded.model, jobs, self._new_batch_generator, crowded)
        for verdict in reversed(verdicts):
            if not verdict.culprit:
                self._start_again(verdict.job)
                continue
            verdict.job.uid = -1
            if is_out_of_memory(verdict.failure):
                why = f"the device ran out of memory running this request alone: {verdict.failure}"
                kind: type[EngineError] = Overloaded
            else:
                why, kind = f"the model failed on this request: {verdict.failure}", ModelFailed
            self._end_failed(verdict.job, why, kind, keep_checkpoint=True)
        if crowded and not any(v.culprit for v in verdicts):
            self._ceiling.lower(len(verdicts))
            log.warning(
                "%d rows ran the device out of memory together, each runs alone: at most %d"
                " run at a time for now",
                len(verdicts),
                self._ceiling.limit(self.limits.max_running),
            )
        with self._lock:
            self._stats.isolated_failures_total += sum(v.culprit for v in verdicts)

    def _end_failed(
        self, job: Job, error: str, failure: type[EngineError], keep_checkpoint: bool = False
    ) -> None:
        """Ends a job the engine failed or refused; its stream ends with failure's status."""
        job.ended = "failed"
        job.keep_checkpoint = job.keep_checkpoint or keep_checkpoint
        self.finish(job)
        self.emit(job, [Finished("error", error=error, failure=failure.__name__)])

    def _cancel_all(self, message: str) -> None:
        for job in list(self._by_id.values()):
            job.keep_checkpoint = True  # shutting down: resumable on another engine
            self._cancel(job.request.request_id, "cancelled", message)
