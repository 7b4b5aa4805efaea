"""Speculative requests, run beside the batch on the MLX thread.

mlx-lm's BatchGenerator has no speculative mode (a batch would need per-row draft lengths and
per-row rollback of every batch cache), so requests with `num_draft_tokens` run solo: after
each batch step, every speculative request does one round (draft k, verify, keep the agreeing
prefix). They share the engine's admission limits, cancel, deadlines, stop handling and
checkpoints with batched requests through `LaneHost` (the scheduler); their checkpoints carry
the draft model's cache as an attachment (engine_service/attachments.py).
"""

from __future__ import annotations

import json
import logging
from typing import Protocol

from mlx_lm.models.cache import make_prompt_cache

from engine_service.attachments import (
    DRAFT_SCHEMA,
    capture_attachment,
    draft_pending,
    restore_attachment,
)
from engine_service.attachments import find as find_attachment
from engine_service.checkpoints import CheckpointManager
from engine_service.events import Event, Finished, FinishReason, Started, Token
from engine_service.jobs import Job, StartingPoint
from engine_service.model import LoadedModel
from engine_service.plans import ResumePlan
from engine_service.sampling import make_processors, requested_logprobs
from engine_service.speculative import SpeculativeDecoder, feed_prompt

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
    ) -> None:
        self.host = host
        self.target = target
        self.draft = draft
        self.checkpoints = checkpoints
        self.jobs: dict[str, Job] = {}  # by request id
        self.decoders: dict[str, SpeculativeDecoder] = {}

    def __len__(self) -> int:
        return len(self.jobs)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.jobs

    def admit(self, job: Job) -> None:
        """Prefills (or restores) both models for a request; emits Started."""
        r = job.request
        try:
            start = self.host.starting_point(job)
            decoder = self._decoder(job, start)
        except Exception as exc:  # a failed prefill ends this request, not the engine
            log.exception("speculative prefill failed")
            self._fail(job, exc)
            return
        decoder.step = len(job.tokens)
        self.jobs[r.request_id] = job
        self.decoders[r.request_id] = decoder
        self.host.emit(job, [Started(len(r.prompt), start.cached_prompt_tokens)])

    def _decoder(self, job: Job, start: StartingPoint) -> SpeculativeDecoder:
        target, req, plan = self.target.model, job.request, job.plan
        processors = make_processors(req.sampling)
        if isinstance(plan, ResumePlan):
            # The target cache holds prompt + generated; the pending token is fed next.
            assert start.caches is not None
            attachment = find_attachment(plan.attachments, DRAFT_SCHEMA)
            if attachment is not None:
                draft_cache = restore_attachment(attachment, self.draft.layout)
                owed = draft_pending(attachment)
            else:  # a checkpoint without the draft's state: rebuild it from the tokens
                draft_cache = make_prompt_cache(self.draft.model)
                feed_prompt(self.draft.model, draft_cache, start.history, 2048)
                owed = []
            return SpeculativeDecoder(
                target,
                self.draft.model,
                start.caches,
                draft_cache,
                plan.pending,
                owed,
                [*start.history, plan.pending],
                req.sampling,
                processors,
                req.num_draft,
            )
        return SpeculativeDecoder.prefill(
            target,
            self.draft.model,
            req.prompt,
            req.sampling,
            processors,
            req.num_draft,
            target_cache=start.caches,
            cached=start.cached_prompt_tokens,
        )

    def remove(self, request_id: str) -> None:
        self.jobs.pop(request_id, None)
        self.decoders.pop(request_id, None)

    def clear(self) -> None:
        self.jobs.clear()
        self.decoders.clear()

    def step(self) -> int:
        """One round for every speculative request; returns the tokens generated."""
        produced = 0
        for request_id, job in list(self.jobs.items()):
            decoder = self.decoders[request_id]
            r = job.request
            try:
                result = decoder.round(job.remaining)
            except Exception as exc:
                log.exception("speculative round failed")
                self.remove(request_id)
                self._fail(job, exc)
                continue
            events: list[Event] = []
            finished: FinishReason | None = None
            for token, logprobs in zip(result.tokens, result.logprobs, strict=True):
                job.tokens.append(token)
                produced += 1
                extra = requested_logprobs(logprobs, token, r.sampling.logprobs)
                events.append(Token(token, *extra))
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
                        drafted=decoder.drafted_total,
                        accepted=decoder.accepted_total,
                    )
                )
                self.remove(request_id)
                self.host.finish(job)
            else:
                self._checkpoint(job, decoder)
            self.host.emit(job, events)
        return produced

    def _fail(self, job: Job, exc: Exception) -> None:
        self.host.finish(job)
        self.host.emit(job, [Finished("error", error=f"generation failed: {exc}")])

    def _checkpoint(self, job: Job, decoder: SpeculativeDecoder) -> None:
        """At a round boundary, when due: the target's caches and the draft's as an
        attachment, with the tokens the draft still owes."""
        ckpt, r = self.checkpoints, job.request
        if ckpt is None or not ckpt.generations.due(job):
            return
        held = len(r.prompt) + len(job.tokens) - 1  # all but the pending token
        attachment = capture_attachment(
            DRAFT_SCHEMA,
            decoder.draft_cache,
            boundary=held,
            held=held - len(decoder.draft_pending),
            draft_model=self.draft.model_id,
            draft_pending=json.dumps(decoder.draft_pending),
        )
        snapshot = ckpt.generations.capture_whole(job, decoder.target_cache, [attachment])
        ckpt.generations.save(job, snapshot, pending=job.tokens[-1])
