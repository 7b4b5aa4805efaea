"""Speculative requests: one batch of their own on the MLX thread (speculative/batch.py).

The requests that asked for speculation draft together and are verified together, one round
per loop iteration, while the other requests step in mlx-lm's BatchGenerator (it has no
speculative mode: a row there advances one token a step). Each request is prefilled solo on
admission (its target prefix restored from a checkpoint or the store when there is one), then
joins the batch. The lane shares the engine's admission limits, cancel, deadlines, stop
handling and checkpoints with batched requests through `LaneHost` (the scheduler); its
checkpoints carry the draft model's cache as an attachment
(engine_service/checkpoints/attachments.py).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from mlx_lm.models.cache import trim_prompt_cache

from engine_service.checkpoints.attachments import (
    DRAFT_SCHEMA,
    capture_attachment,
    draft_pending,
    restore_attachment,
)
from engine_service.checkpoints.attachments import find as find_attachment
from engine_service.checkpoints.manager import CheckpointManager
from engine_service.core.plans import ResumePlan
from engine_service.device_memory import cache_given_back
from engine_service.errors import Overloaded
from engine_service.loop.compiled_decode import CompiledDecode
from engine_service.loop.jobs import Job, StartingPoint
from engine_service.model.loaded import LoadedModel
from engine_service.protocol.engine_stats import SpeculativeCounters
from engine_service.protocol.events import Event, Finished, FinishReason, Started
from engine_service.sampling.samplers import make_processors
from engine_service.speculative.batch import (
    SpecRow,
    SpeculativeBatch,
    prefilled,
)

log = logging.getLogger(__name__)


class LaneHost(Protocol):
    """What the lane needs of the loop that owns it."""

    def starting_point(self, job: Job) -> StartingPoint: ...

    def emit(self, job: Job, events: list[Event]) -> None: ...

    def finish(self, job: Job) -> None: ...


class SpeculativeLane:
    def __init__(
        self,
        host: LaneHost,
        target: LoadedModel,
        draft: LoadedModel,
        checkpoints: CheckpointManager | None = None,
        prefill_step: int = 2048,
        compiled_draft_max_batch: int = 0,
    ) -> None:
        self.host = host
        self.target = target
        self.draft = draft
        self.checkpoints = checkpoints
        self.prefill_step = prefill_step
        # The draft's one-token steps compiled for small batches (loop/compiled_decode.py), as the
        # engine's own decode is with --compiled-decode: they are host-bound.
        self._draft_steps = (
            CompiledDecode(draft.model, compiled_draft_max_batch)
            if compiled_draft_max_batch > 0
            else draft.model
        )
        self.jobs: dict[str, Job] = {}  # by request id
        self.counters = SpeculativeCounters()
        self.batch = SpeculativeBatch(target.model, self._draft_steps, self.counters)

    def __len__(self) -> int:
        return len(self.jobs)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.jobs

    def admit(self, job: Job) -> None:
        """Prefills (or restores) both models for a request, joins it to the batch; emits
        Started."""
        r = job.request
        try:
            start = self.host.starting_point(job)
            row, target_cache, draft_cache = self._row(job, start)
            self.batch.add(row, target_cache, draft_cache)
        except Exception as exc:  # a failed prefill ends this request, not the engine
            log.exception("speculative prefill failed")
            self._fail(job, exc)
            return
        self.jobs[r.request_id] = job
        cached, why = start.cached_prompt_tokens, start.prefix_miss_reason
        self.host.emit(job, [Started(len(r.prompt), cached, why, start.prefix_source)])

    def _row(self, job: Job, start: StartingPoint) -> tuple[SpecRow, list[Any], list[Any]]:
        """The row and its solo caches: the target holding all of the history but its last
        token, the draft all but the last two."""
        req, plan = job.request, job.plan
        if isinstance(plan, ResumePlan):
            assert start.caches is not None
            target_cache = start.caches
            history = [*start.history, plan.pending]
            attachment = find_attachment(plan.attachments, DRAFT_SCHEMA)
            if attachment is not None:
                draft_cache = restore_attachment(attachment, self.draft.layout)
                # A draft that owes fewer than two tokens (an older lane's checkpoint) gives
                # the rest back: its caches are trimmable (checked at start-up).
                trim_prompt_cache(draft_cache, max(0, 1 - len(draft_pending(attachment))))
            else:  # a checkpoint without the draft's state: rebuild it from the tokens
                draft_cache = prefilled(self.draft.model, history[:-2], self.prefill_step)
        else:
            history = list(req.prompt)
            target_cache = prefilled(
                self.target.model,
                history[:-1],
                self.prefill_step,
                start.caches,
                start.cached_prompt_tokens,
            )
            draft_cache = prefilled(self.draft.model, history[:-2], self.prefill_step)
        row = SpecRow(
            req.request_id,
            history,
            len(job.tokens),
            req.num_draft,
            req.sampling,
            make_processors(req.sampling),
            req.kv,
        )
        return row, target_cache, draft_cache

    def remove(self, request_id: str) -> None:
        if self.jobs.pop(request_id, None) is not None:
            self.batch.remove(request_id)

    def clear(self) -> None:
        self.jobs.clear()
        self.batch = SpeculativeBatch(self.target.model, self._draft_steps, self.counters)

    def step(self) -> int:
        """One round for every speculative request; returns the tokens generated."""
        rows = list(self.batch.rows)
        try:
            results = self.batch.round([self.jobs[row.request_id].remaining for row in rows])
        except Exception as exc:
            log.exception("speculative round failed")
            for row in rows:
                job = self.jobs.pop(row.request_id)
                self._fail(job, exc)
            self.clear()
            return 0
        produced = 0
        for row, result in zip(rows, results, strict=True):
            job = self.jobs[row.request_id]
            r = job.request
            events: list[Event] = []
            finished: FinishReason | None = None
            for token, logprobs in zip(result.tokens, result.logprobs, strict=True):
                job.tokens.append(token)
                produced += 1
                events.append(job.token_event(len(job.tokens) - 1, token, logprobs))
                if token in r.stop_ids:
                    finished = "stop"
                    break
            if finished is None and len(job.tokens) >= r.max_tokens:
                finished = "length"
            if finished is not None:
                events.append(
                    Finished(
                        finished,
                        stop_token=job.tokens[-1] if finished == "stop" else None,
                        drafted=row.drafted,
                        accepted=row.accepted,
                    )
                )
                self.remove(r.request_id)
                self.host.finish(job)
            else:
                self._checkpoint(job)
            self.host.emit(job, events)
        return produced

    def _fail(self, job: Job, exc: Exception) -> None:
        """Ends the request: RESOURCE_EXHAUSTED when the device ran out of memory (MLX's cached
        buffers go back for the rows after it: loop/memory_pressure.py), else INTERNAL."""
        failure = Overloaded.__name__ if cache_given_back(exc) else ""
        self.host.finish(job)
        self.host.emit(job, [Finished("error", error=f"generation failed: {exc}", failure=failure)])

    def _checkpoint(self, job: Job) -> None:
        """At a round boundary, when due: the target's caches and the draft's as an
        attachment; the draft owes the history's last two tokens (the pending one is not in
        the attachment's count, the one before it is `draft_pending`)."""
        ckpt, r = self.checkpoints, job.request
        if ckpt is None or not ckpt.generations.due(job):
            return
        held = len(r.prompt) + len(job.tokens) - 1  # all but the pending token
        target_cache, draft_cache = self.batch.extract(r.request_id)
        owed = job.tokens[-2:-1] if len(job.tokens) > 1 else r.prompt[-1:]
        attachment = capture_attachment(
            DRAFT_SCHEMA,
            draft_cache,
            boundary=held,
            held=held - 1,
            draft_model=self.draft.model_id,
            draft_pending=json.dumps(owed),
        )
        snapshot = ckpt.generations.capture_whole(job, target_cache, [attachment])
        ckpt.generations.save(job, snapshot, pending=job.tokens[-1])
