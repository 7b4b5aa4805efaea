"""Speculative requests, run beside the batch on the MLX thread.

mlx-lm's BatchGenerator has no speculative mode (a batch would need per-row draft lengths and
per-row rollback of every batch cache), so requests with `num_draft_tokens` run solo: after
each batch step, every speculative request does one round (draft k, verify, keep the agreeing
prefix). They share the engine's admission limits, cancel, deadlines, stop handling and
checkpoints with batched requests; their checkpoints carry the draft model's cache as an
attachment (engine_service/attachments.py).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine_service.attachments import (
    DRAFT_SCHEMA,
    capture_attachment,
    draft_pending,
    restore_attachment,
)
from engine_service.attachments import find as find_attachment
from engine_service.cache_codec import capture
from engine_service.checkpoints import ResumePlan
from engine_service.events import Event, Finished, Started, Token
from engine_service.model import LoadedModel
from engine_service.sampling import make_processors, token_logprobs
from engine_service.speculative import SpeculativeDecoder, feed_prompt

if TYPE_CHECKING:
    from engine_service.scheduler import Scheduler, _Job

log = logging.getLogger(__name__)


class SpeculativeLane:
    def __init__(self, owner: Scheduler, draft: LoadedModel) -> None:
        self.owner = owner
        self.draft = draft
        self.jobs: dict[str, _Job] = {}  # by request id
        self.decoders: dict[str, SpeculativeDecoder] = {}

    def __len__(self) -> int:
        return len(self.jobs)

    def admit(self, job: _Job) -> None:
        """Prefills (or restores) both models for a request; emits Started."""
        owner, r = self.owner, job.request
        try:
            prompt, history, cache, cached = owner._starting_point(job)
            decoder = self._decoder(job, history, cache, cached)
        except Exception as exc:  # a failed prefill ends this request, not the engine
            log.exception("speculative prefill failed")
            owner._forget(job)
            owner._emit(job, [Finished("error", error=f"generation failed: {exc}")])
            return
        decoder.step = len(job.tokens)
        self.jobs[r.request_id] = job
        self.decoders[r.request_id] = decoder
        owner._emit(job, [Started(len(r.prompt), cached)])

    def _decoder(
        self, job: _Job, history: list[int], cache: Any, cached: int
    ) -> SpeculativeDecoder:
        target = self.owner.loaded.model
        req = job.request
        processors = make_processors(req.sampling)
        plan = job.plan
        if isinstance(plan, ResumePlan):
            # The target cache holds prompt + generated; the pending token is fed next.
            attachment = find_attachment(plan.attachments, DRAFT_SCHEMA)
            if attachment is not None:
                draft_cache = restore_attachment(attachment, self.draft.layout)
                owed = draft_pending(attachment)
            else:  # a checkpoint without the draft's state: rebuild it from the tokens
                draft_cache = make_prompt_cache(self.draft.model)
                feed_prompt(self.draft.model, draft_cache, history, 2048)
                owed = []
            return SpeculativeDecoder(
                target,
                self.draft.model,
                cache,
                draft_cache,
                plan.pending,
                owed,
                [*history, plan.pending],
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
            target_cache=cache,
            cached=cached,
        )

    def remove(self, request_id: str) -> None:
        self.jobs.pop(request_id, None)
        self.decoders.pop(request_id, None)

    def clear(self) -> None:
        self.jobs.clear()
        self.decoders.clear()

    def step(self) -> int:
        """One round for every speculative request; returns the tokens generated."""
        owner = self.owner
        produced = 0
        for request_id, job in list(self.jobs.items()):
            decoder = self.decoders[request_id]
            r = job.request
            try:
                result = decoder.round(r.max_tokens - len(job.tokens))
            except Exception as exc:
                log.exception("speculative round failed")
                self.remove(request_id)
                owner._forget(job)
                owner._emit(job, [Finished("error", error=f"generation failed: {exc}")])
                continue
            events: list[Event] = []
            finished = None
            for token, logprobs in zip(result.tokens, result.logprobs, strict=True):
                job.tokens.append(token)
                job.generated += 1
                produced += 1
                events.append(Token(token, *_logprob(logprobs, token, r.sampling.logprobs)))
                if token in job.stop_ids:
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
                owner._forget(job)
            else:
                self._checkpoint(job, decoder)
            owner._emit(job, events)
        return produced

    def _checkpoint(self, job: _Job, decoder: SpeculativeDecoder) -> None:
        """At a round boundary, when due: the target's caches and the draft's as an
        attachment, with the tokens the draft still owes."""
        ckpt, r = self.owner.checkpoints, job.request
        if ckpt is None or not job.checkpoint_key:
            return
        if len(job.tokens) - job.last_checkpoint_at < r.checkpoint_interval:
            return
        held = len(r.prompt) + len(job.tokens) - 1  # all but the pending token
        captured = capture(decoder.target_cache, held, wait=False)
        draft_held = held - len(decoder.draft_pending)
        attachment = capture_attachment(
            DRAFT_SCHEMA,
            decoder.draft_cache,
            boundary=held,
            held=draft_held,
            draft_model=self.draft.model_id,
            draft_pending=json.dumps(decoder.draft_pending),
        )
        ckpt.save_generation(
            job.checkpoint_key,
            r.namespace,
            captured,
            r.prompt,
            job.tokens[:-1],
            job.tokens[-1],
            r.sampling,
            r.max_tokens,
            r.layout,
            None,
            [attachment],
        )
        job.checkpointed = True
        job.last_checkpoint_at = len(job.tokens)


def _logprob(
    logprobs: mx.array, token: int, top_n: int
) -> tuple[float | None, list[tuple[int, float]] | None]:
    if top_n < 0:
        return None, None
    return token_logprobs(logprobs, token, top_n)
