"""A batch step that raised: find the rows the model fails on, and keep the others going.

A forward pass that raises leaves the batch's caches half-written (the layers before the
failing one stored their step), so no row can go on from them. Each row is tried alone
instead, from its tokens: prompt and generated tokens recomputed in a scratch batch of its
own, a step or two past them, nothing delivered. A row that fails alone ends (ModelFailed,
its checkpoint kept); the others start again by recompute in the fresh batch and go on from
the token they were at (samplers are keyed by step, constraints replayed). When every row
runs alone, the failure needs them together: all end, since the same batch would fail again.

The start-up probe (core/capability_probe.py) refuses the kinds of rows known to fail; this is the
net for the ones nobody knew of.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import BatchGenerator

from engine_service.loop.jobs import Job, StartingPoint
from engine_service.loop.new_rows import NewRows

log = logging.getLogger(__name__)

TRIAL_TOKENS = 2  # the first token (after the prefill) and one decode step


@dataclass(frozen=True)
class Verdict:
    """A row of a failed step, tried alone: why it failed there, or "" when it ran."""

    job: Job
    failure: str

    @property
    def culprit(self) -> bool:
        return bool(self.failure)


def recompute_point(job: Job) -> StartingPoint:
    """Where a row starts again without caches: its prompt and every generated token fed
    (the last one is the pending token), the sampler going on at step len(job.tokens)."""
    return StartingPoint([*job.request.prompt, *job.tokens], [], None, 0)


def try_alone(model: Any, job: Job, new_batch: Callable[[], BatchGenerator]) -> Verdict:
    """Runs one row alone from its tokens in a scratch batch (MLX thread).

    Its copy runs without a constraint and stop tokens (a grammar's matcher is stateful and
    a stop would end the trial before its decode step); the job itself is untouched."""
    r = job.request
    trial_request = dataclasses.replace(
        r,
        request_id=f"trial-{r.request_id}",
        sampling=dataclasses.replace(r.sampling, constraint=None),
        stop_ids=frozenset(),
        max_tokens=len(job.tokens) + TRIAL_TOKENS,
    )
    trial = Job(trial_request, _discard, tokens=list(job.tokens))
    rows = NewRows(model)
    try:
        rows.add(trial, recompute_point(job))
        batch = new_batch()
        rows.insert(batch)
        done = False
        while not done:
            _, responses = batch.next()
            done = any(x.finish_reason is not None for x in responses)
    except Exception as exc:  # noqa: BLE001 - what the model raises is the verdict
        text = str(exc).strip().splitlines()
        return Verdict(job, (text[0] if text else type(exc).__name__)[:300])
    return Verdict(job, "")


def isolate(
    model: Any, jobs: list[Job], new_batch: Callable[[], BatchGenerator], crowded: bool = False
) -> list[Verdict]:
    """Each row of a failed step tried alone; every row a culprit when none fails alone,
    unless the step failed for want of memory (crowded: they run again, fewer at a time)."""
    verdicts = [try_alone(model, job, new_batch) for job in jobs]
    if not any(v.culprit for v in verdicts) and not crowded:
        log.error("the step failed with %d rows that each run alone: all of them end", len(jobs))
        return [Verdict(job, "the batch failed with this row in it") for job in jobs]
    return verdicts


def _discard(events: object) -> None:
    pass
