"""The engine loop: one thread owns every MLX call and drives mlx-lm's BatchGenerator.

gRPC handlers never touch MLX. They submit a request with a `sink` (a thread-safe callable
that takes a list of events) and may cancel it; the loop admits requests between decode
steps, steps the batch, and pushes each request's events to its sink: Started, Token per
generated token, and exactly one Finished. The loop never waits on the network.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import time

from engine_service.checkpoints.manager import CheckpointManager, starting_point
from engine_service.core.capability_probe import ProbeFailed, kv_refusal, prepare_to_serve
from engine_service.core.plans import PrefixPlan
from engine_service.device_memory import cache_given_back, is_out_of_memory
from engine_service.errors import Corrupt, InvalidRequest, Overloaded
from engine_service.loop.admissions import gather_burst
from engine_service.loop.batch_model import batch_model
from engine_service.loop.commands import Cancel, Park, Restored, Submit, Unpark
from engine_service.loop.first_tokens import FirstTokens
from engine_service.loop.idle_buffers import IdleBuffers, bound_cache
from engine_service.loop.inbox import SchedulerInbox
from engine_service.loop.jobs import Job, StartingPoint
from engine_service.loop.limits import Limits
from engine_service.loop.memory_pressure import RowCeiling
from engine_service.loop.new_rows import NewRows
from engine_service.loop.parking import Parking
from engine_service.loop.preemption import Preemption, restart_point
from engine_service.loop.read_confirmations import ReadConfirmations
from engine_service.loop.row_endings import RowEndings
from engine_service.loop.row_isolation import recompute_point
from engine_service.loop.step_checkpoints import StepCheckpoints
from engine_service.loop.warmup import WarmUpFailed, warm_up
from engine_service.model.folded_prefill import FoldingBatchGenerator, fold_limit
from engine_service.model.last_positions import LastPositions
from engine_service.model.loaded import LoadedModel
from engine_service.model.mlx_compat import batch_cache_bytes, running_batch
from engine_service.protocol.events import (
    Deliver,
    Event,
    Finished,
    Sink,
    Started,
)
from engine_service.sampling.constraints import Grammars
from engine_service.sampling.masks import BatchMasks
from engine_service.speculative.lane import SpeculativeLane

log = logging.getLogger(__name__)

KV_BYTES_EVERY = 16  # steps between readings of the batch's KV bytes (Stats.kv_cache_bytes)

# An idle engine receiving a burst gathers it for at most this many admission windows.
GATHER_WINDOWS = 25


def deliver_directly(outbox: list[tuple[Sink, list[Event]]]) -> None:
    for sink, events in outbox:
        sink(events)


class Scheduler(SchedulerInbox, RowEndings, FirstTokens):
    """The engine thread's half: admits, steps the batch, ends rows, delivers events."""

    def __init__(
        self,
        loaded: LoadedModel,
        limits: Limits,
        deliver: Deliver = deliver_directly,
        checkpoints: CheckpointManager | None = None,
        draft: LoadedModel | None = None,
        compiled_decode_max_batch: int = 0,
        grammars: Grammars | None = None,
        deterministic_rows: int | None = None,
        deterministic_kernel: bool = False,
        deterministic_rows_alone: bool | None = None,
    ) -> None:
        self.loaded = loaded
        self.deterministic = deterministic_rows is not None
        model = batch_model(
            loaded.model,
            compiled_decode_max_batch,
            deterministic_rows,
            deterministic_kernel,
            deterministic_rows_alone,
        )
        # Structured output: constrained rows' masks, all rows of a step together.
        self._masks = BatchMasks(model, loaded.vocab_size, lambda: running_batch(self._bg))
        self._batch_model = self._masks
        self.checkpoints = checkpoints
        # Constraints compiled here (the core), on its planning pool; the tokenizer llguidance
        # needs is built on the first one.
        self.grammars = grammars if grammars is not None else Grammars.for_model(loaded)
        # Requests with num_draft_tokens run as a batch of their own (speculative/lane.py).
        self._speculative = (
            SpeculativeLane(
                self,
                loaded,
                draft,
                checkpoints,
                limits.prefill_step_size,
                compiled_decode_max_batch,
            )
            if draft is not None
            else None
        )
        super().__init__(limits, StepCheckpoints(checkpoints) if checkpoints else None)
        self.deliver = deliver
        self._outbox: list[tuple[Sink, list[Event]]] = []
        self._waiting: collections.deque[Job] = collections.deque()
        self._unconfirmed = ReadConfirmations()  # direct store hits in their first step
        self._rows: dict[int, Job] = {}
        self._by_id: dict[str, Job] = {}
        self._cancels_due: set[str] = set()
        self._preemption = Preemption(limits.park)
        self._ceiling = RowCeiling()
        self._parking = Parking(
            self, self._preemption, checkpoints, self._waiting, self._by_id, self._inbox.put
        )
        self._bg: FoldingBatchGenerator  # made on the engine thread: MLX streams are per thread
        # A prompt's last chunk gives its first token (model/folded_prefill.py; probed on the
        # engine thread); not in deterministic mode, where its last token is a step of its own.
        self._last_positions: LastPositions | None = None
        self._fold_max_tokens = fold_limit(loaded.model)  # its weights' sizes: read once

    def _new_batch_generator(self) -> FoldingBatchGenerator:
        return FoldingBatchGenerator(
            self._batch_model,
            self._last_positions,
            self._fold_max_tokens,
            completion_batch_size=self.limits.max_running,
            prefill_batch_size=min(self.limits.prefill_batch_size, self.limits.max_running),
            prefill_step_size=self.limits.prefill_step_size,
        )

    # -- what the speculative lane uses (LaneHost) -------------------------------------------

    def emit(self, job: Job, events: list[Event]) -> None:
        """Queues a job's events; they leave together at the end of the step. Nothing leaves
        after its stream's Finished (a row told with its first token ends a step later)."""
        if job.stream_ended:
            return
        self._outbox.append((job.sink, events))
        if any(isinstance(event, Finished) for event in events):
            job.stream_ended = True
            self._release_id(job)  # its client may use the id again at once

    def _release_id(self, job: Job) -> None:
        """The job's request id is free again (once: at its Finished or its end)."""
        if not job.id_released:
            job.id_released = True
            self._admissions.leave(job.request.request_id)

    def finish(self, job: Job) -> None:
        """Forgets a job that ended; its generation checkpoint goes unless it is kept."""
        if self.checkpoints is not None:
            # A round staged at the last step reaches the store first, before a tombstone
            # and whatever a resumed generation of the same key writes later.
            self.checkpoints.generations.complete_round()
        if job.checkpointed and not job.keep_checkpoint and self.checkpoints is not None:
            self.checkpoints.generations.forget(job)
        self._rows.pop(job.uid, None)
        if self._by_id.get(job.request.request_id) is job:  # not a new job of the same id
            del self._by_id[job.request.request_id]
        self._preemption.forget(job)
        if self._step_checkpoints is not None:
            self._step_checkpoints.forget(job)
        self._release_id(job)

    def starting_point(self, job: Job, confirm_later: bool = False) -> StartingPoint:
        if job.recompute:  # its batch failed under it (loop/row_isolation.py)
            job.recompute, job.restored_prefix = False, None
            return recompute_point(job)
        parked = self._preemption.restart_from(job)
        if parked is not None:
            ckpt = self.checkpoints
            return restart_point(job, parked, ckpt.generations.loads.materialize if ckpt else None)
        return starting_point(job, self.checkpoints, confirm_later)

    # -- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        if cap := bound_cache():
            log.info("MLX's buffer cache holds at most %d MiB", cap >> 20)
        if not self.deterministic:
            self._last_positions = LastPositions.probe(self._batch_model)
        self._bg = self._new_batch_generator()
        try:  # what the model runs (core/capability_probe.py), then the warm-up
            limits = self.limits
            sizes = [1, min(limits.prefill_batch_size, limits.max_running), limits.max_running]
            prepare_to_serve(self.loaded, limits.default_kv, self._new_batch_generator)
            if self._warm:
                warm_up(self._bg, self.loaded, sizes, limits.prefill_step_size, limits.default_kv)
        except (ProbeFailed, WarmUpFailed) as exc:
            self._start_failure = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except Exception:  # the core notices the thread is gone and exits (core/process.py)
            log.exception("the engine loop failed")

    def _loop(self) -> None:
        buffers = IdleBuffers()  # MLX's cached buffers go back after a while idle
        while True:
            idle = not self._rows and not self._waiting and not self._speculating()
            if buffers.tick(idle):
                self._stats.kv_cache_bytes = 0
            waiting_before = len(self._waiting)
            if not self._drain_inbox(block=idle):
                break
            if len(self._waiting) > waiting_before and not self._gather_burst(idle):
                break
            self._admit()
            self._expire_deadlines()
            self._expire_idle()
            if self._rows:
                self._step()
            self._confirm_reads()  # any whose rows ended before a step ran over them
            if self._speculating():
                self._step_speculative()
            self._publish_counts()
            self._flush_outbox()
            if self._step_checkpoints is not None:
                self._step_checkpoints.save_prefixes(self._bg)
            self._end_cancels_due()
        self._cancel_all("the engine is shutting down")
        self._flush_outbox()

    def _gather_burst(self, idle: bool) -> bool:
        """The rest of a burst of arrivals (admissions.gather_burst); False: asked to stop."""
        return gather_burst(
            self.limits.admission_window_s,
            GATHER_WINDOWS if idle else 1,
            lambda: self._running() + len(self._waiting) < self.limits.max_running,
            lambda: len(self._waiting),
            lambda: self._drain_inbox(block=False),
            # default: a cancel drained meanwhile may have emptied the queue
            lambda: max((job.arrived_at for job in self._waiting), default=0.0),
        )

    def _flush_outbox(self) -> None:
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            self.deliver(outbox)

    def _drain_inbox(self, block: bool) -> bool:
        """Applies queued commands; False when asked to stop."""
        while True:
            try:
                command = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, Submit):
                self._waiting.append(command.job)
                self._by_id[command.job.request.request_id] = command.job
            elif isinstance(command, Cancel):
                job = self._by_id.get(command.request_id)
                if job is not None:
                    job.keep_checkpoint = command.keep_checkpoint
                    job.ended = "finished" if command.stopped else "was cancelled"
                self._cancel_keeping(command.request_id)
            elif isinstance(command, (Park, Unpark)):
                self._parking.command(command)
            elif isinstance(command, Restored):
                self._parking.restored(command)
            else:
                return False

    def _running(self) -> int:
        return len(self._rows) + (len(self._speculative) if self._speculative else 0)

    def _speculating(self) -> bool:
        return bool(self._speculative and len(self._speculative))

    def _step_speculative(self) -> None:
        assert self._speculative is not None
        produced = self._speculative.step()
        with self._lock:
            self._stats.add_tokens(produced, time.monotonic())
            self._stats.speculative = dataclasses.replace(self._speculative.counters)

    def _admit(self) -> None:
        free = self._ceiling.limit(self.limits.max_running) - self._running()
        batch, arriving = [], []
        while free > 0 and self._waiting:
            job = self._waiting.popleft()
            if self._rows and isinstance(job.plan, PrefixPlan) and job.plan.arriving:
                # The store is still copying its prefix: admitted at a later step, so the
                # running rows never wait for the store (an idle engine pulls as it copies).
                arriving.append(job)
                continue
            # A KV scheme the model cannot run is refused before the row joins a batch.
            try:
                refusal = kv_refusal(self.loaded, job.request.kv, self._new_batch_generator)
            except Exception as exc:  # only a device out of memory gets here
                if not cache_given_back(exc):
                    raise
                why = f"the device ran out of memory probing this request's KV codec: {exc}"
                self._end_failed(job, why, Overloaded)
                continue
            if self.deterministic and job.request.kv.quantized:
                refusal = "this engine runs --deterministic: KV codecs are not batch-invariant"
            if refusal:
                self._end_failed(job, refusal, InvalidRequest)
                continue
            free -= 1
            if not job.admitted_at:
                self._prepare(job)
            if job.request.num_draft and self._speculative is not None:
                self._speculative.admit(job)
            else:
                batch.append(job)
        self._waiting.extendleft(reversed(arriving))
        if not batch:
            return
        rows = NewRows(self.loaded.model, self.grammars)
        for job in batch:
            fresh = not job.tokens and not job.recompute  # not a row coming back
            try:
                start = self.starting_point(job, confirm_later=True)
                rows.add(job, start)
            except Exception as exc:  # a checkpoint that cannot be restored ends its request
                log.exception("restoring %s failed", job.request.request_id)
                memory = is_out_of_memory(exc)  # not the checkpoint: a retry may fit
                failure = Overloaded if memory else Corrupt
                self._end_failed(job, f"restoring the checkpoint failed: {exc}", failure, memory)
                continue
            started = None
            if fresh:
                cached, why = start.cached_prompt_tokens, start.prefix_miss_reason
                started = Started(len(job.request.prompt), cached, why, start.prefix_source)
            if start.unconfirmed is not None:  # Started is said once the read is confirmed
                self._unconfirmed.add(job, start.unconfirmed, started)
            elif started is not None:
                self.emit(job, [started])
        if not rows.jobs:
            return
        rows.insert(self._bg)
        self._parking.joined(rows.jobs)
        for job in rows.jobs:
            self._rows[job.uid] = job
            if job.constrained is not None:
                self._masks.add(job.constrained)
        with self._lock:
            self._stats.prompt_tokens_total += rows.prompt_tokens

    def _prepare(self, job: Job) -> None:
        """What every admitted request needs: its admission time and checkpoint key."""
        job.admit()
        if self.checkpoints is not None:
            self.checkpoints.generations.enroll(job)

    def _step(self) -> None:
        try:
            _, responses = self._bg.next()
            # Evaluated here, part of the step (the fold's last layer is in their graph); sent
            # once the step's direct store reads are confirmed.
            first_tokens = self._bg.first_tokens()
        except Exception as exc:  # a row the model fails on must not end the rows beside it
            log.exception("a batch step of %d rows failed; trying each alone", len(self._rows))
            self._confirm_reads(step_failed=True)
            self._isolate(exc)
            return
        self._ceiling.stepped(self.limits.max_running)
        self._confirm_reads()
        self._masks.settle(self._rows)
        self._send_first_tokens(first_tokens)
        if not responses:
            return
        for r in responses:
            job = self._rows.get(r.uid)
            if job is None:
                continue  # removed (cancelled) while its token was in flight
            if job.stream_ended and r.finish_reason is None:  # never: ending_at is mlx-lm's
                log.error("row %d goes on after its stream ended; it leaves", r.uid)
                self._bg.remove([r.uid])
                self.finish(job)
                continue
            job.tokens.append(r.token)
            sent = job.token_sent_ahead
            job.token_sent_ahead = None
            if sent is None and job.at_first_new_token():
                log.debug("first token phases, %s", job.first_token_phases())
            events: list[Event] = []
            if sent is None:
                events.append(job.token_event(len(job.tokens) - 1, r.token, r.logprobs))
            if sent is not None and sent != r.token:  # one array, read twice: never
                log.error("row %d reported %d after %d was sent", r.uid, r.token, sent)
            if self._step_checkpoints is not None:
                finished_cache = r.prompt_cache if r.finish_reason is not None else None
                self._step_checkpoints.after_token(job, self._bg, finished_cache)
            if r.finish_reason is not None:
                events.append(job.finished_by(r.finish_reason, r.token))
                self.finish(job)
            if events:  # none: its token went ahead and it goes on
                self.emit(job, events)
        if self._step_checkpoints is not None:
            self._step_checkpoints.save_ready(self._rows)
            self._step_checkpoints.capture_due(self._bg, self._rows, self._stats.steps_total)
        free = self._ceiling.limit(self.limits.max_running) - self._running()
        self._parking.step(self._bg, self._rows, free)
        with self._lock:
            self._stats.add_step(len(responses), time.monotonic())
            if self._stats.steps_total % KV_BYTES_EVERY == 0:  # a sum over layers: not each step
                self._stats.kv_cache_bytes = batch_cache_bytes(self._bg)

    def _publish_counts(self) -> None:
        with self._lock:
            self._stats.running = self._running()
            self._stats.queued = len(self._waiting)
            self._stats.row_ceiling = self._ceiling.rows or 0
            self._stats.parking = dataclasses.replace(self._preemption.counters)
