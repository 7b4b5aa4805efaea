"""New rows for mlx-lm's BatchGenerator: what `insert` takes, gathered job by job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from engine_service.kv.batch_cache import adopt_row
from engine_service.loop.jobs import Job, StartingPoint
from engine_service.model.folded_prefill import FoldingBatchGenerator
from engine_service.sampling.constraints import Grammars
from engine_service.sampling.samplers import make_processors, make_sampler


@dataclass
class NewRows:
    model: Any
    grammars: Grammars | None = None  # structured output's compiler (None: no constraints)
    jobs: list[Job] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    histories: list[list[int]] = field(default_factory=list)
    caches: list[list[Any]] = field(default_factory=list)
    max_tokens: list[int] = field(default_factory=list)
    samplers: list[Any] = field(default_factory=list)
    processors: list[Any] = field(default_factory=list)
    stops: list[StopSequences] = field(default_factory=list)

    def add(self, job: Job, start: StartingPoint) -> None:
        r = job.request
        self.jobs.append(job)
        self.prompts.append(start.feed)
        self.histories.append(start.history)
        # The plain KV layers become rows of a BatchQuantizedKVCache carrying the request's
        # codec (plain requests too: any two requests may then share a batch).
        fresh = start.caches if start.caches is not None else make_prompt_cache(self.model)
        self.caches.append([adopt_row(c, r.kv) for c in fresh])
        self.max_tokens.append(job.remaining)
        # The sampler goes on at the job's step: a resumed or parked row samples as if it
        # had never stopped.
        self.samplers.append(make_sampler(r.sampling, start_step=len(job.tokens)))
        processors = make_processors(r.sampling)
        if r.sampling.constraint is not None:
            assert self.grammars is not None, "a constrained request needs the engine's Grammars"
            # The matcher goes past what the row generated already (a resume, a parked row).
            job.constrained = self.grammars.row(r.sampling.constraint, job.tokens)
            processors = [*processors, job.constrained]
        self.processors.append(processors)
        self.stops.append(StopSequences([[t] for t in sorted(r.stop_ids)]))

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def insert(self, bg: BatchGenerator) -> None:
        """Into the batch; each job gets its row uid."""
        uids = bg.insert(
            self.prompts,
            max_tokens=self.max_tokens,
            caches=self.caches,
            all_tokens=self.histories,
            samplers=self.samplers,  # None = the shared greedy one
            logits_processors=self.processors,
            stop_sequences=self.stops,
        )
        for job, uid in zip(self.jobs, uids, strict=True):
            job.uid = uid
            if job.request.kv.quantized and isinstance(bg, FoldingBatchGenerator):
                bg.keep_apart([uid])  # as mlx-lm's QuantizedKVCache (model/folded_prefill.py)
            if job.constrained is not None:
                job.constrained.uid = uid
