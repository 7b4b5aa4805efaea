"""What the engine loop does for checkpoints around each batch step (MLX thread).

After a row's token: a pending generation snapshot is ready now that its pending token is
known, the row is marked when its next snapshot is due, and its prompt's prefix is marked for
saving (first token). After the step's tokens: the ready snapshots are saved together
(save_ready), then the due rows are captured together (capture_due).
After the step's events have left: the marked prefixes are saved (save_prefixes), so the
capture of a long prompt's caches never delays its first token; a checkpointed generation
takes its first snapshot from the same extraction, so it can be resumed from its first token.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import BatchGenerator

from engine_service.checkpoints.generation_meta import ChainBase
from engine_service.checkpoints.manager import CheckpointManager
from engine_service.checkpoints.segment_capture import capture_together
from engine_service.loop.jobs import Job, PendingSnapshot, ReadySnapshot
from engine_service.model.mlx_compat import pending_logprobs, pending_tokens, running_batch

log = logging.getLogger(__name__)

# Generation snapshots are taken on steps that are multiples of this (see capture_due).
CHECKPOINT_ALIGN = 8


@dataclass
class PrefixDue:
    """A prompt whose caches are saved once its first token has been delivered."""

    job: Job
    finished_cache: list[Any] | None  # a row that left the batch; else read from the batch


class StepCheckpoints:
    def __init__(self, checkpoints: CheckpointManager) -> None:
        self.checkpoints = checkpoints
        self._due: dict[int, Job] = {}  # rows whose generation checkpoint is due, by uid
        self._prefixes_due: list[PrefixDue] = []
        self._ready: list[ReadySnapshot] = []  # saved together at the step's end (save_ready)
        # Held from a prefix's first token until the prefix is queued for the store, so a
        # Flush asked after that token covers it (queued_saves). A first token sent before
        # the step that reports it (expect_prefix) holds it from then.
        self._saving = threading.Lock()
        self._held = False
        self._expected: set[int] = set()  # id(job): first tokens sent, not reported yet

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
                self._ready.append(ReadySnapshot(job, snapshot, pending=job.tokens[-1]))
        if len(job.tokens) == 1 and not job.resumed:
            seconds = time.monotonic() - job.admitted_at
            ckpt.add_prefill_time(seconds)
            if job.plan is None:  # a whole prefill: the rate a store hit is weighed against
                ckpt.prefixes.cost.observe_prefill(len(r.prompt), seconds)
            self._expected.discard(id(job))
            self._hold()
            self._prefixes_due.append(PrefixDue(job, finished_cache))
        if finished_cache is None and ckpt.generations.due(job):
            self._due[job.uid] = job

    def save_ready(self, rows: dict[int, Job]) -> None:
        """Saves the snapshots this step's tokens made ready, together (after the step's
        tokens, before its captures); they reach the spill queue at the next step."""
        ready, self._ready = self._ready, []
        ready = [r for r in ready if rows.get(r.job.uid) is r.job]  # still running
        generations = self.checkpoints.generations
        if not ready and not generations.round_staged:
            return  # no checkpoint work this step (nothing counted)
        started = time.perf_counter()
        # Every step: the round staged at the previous one is queued first.
        generations.save_round(ready)
        self._count(started)

    def capture_due(self, bg: BatchGenerator, rows: dict[int, Job], step: int) -> None:
        """Snapshots every row whose checkpoint is due, together, on aligned steps.

        Extracting a row from mlx-lm's batch cache evaluates the batch's padding, a sync with
        the step in flight; rows captured one at a time paid it each (~11% of decode at 8
        streams every 16 tokens), rows captured together pay it once (~4%). A checkpoint is
        therefore up to CHECKPOINT_ALIGN - 1 tokens later than its interval. Plain KV rows are
        cut from the batch together (checkpoints/segment_capture.py), the others row by row.
        """
        if not self._due or step % CHECKPOINT_ALIGN:
            return
        started = time.perf_counter()
        jobs = [job for uid, job in self._due.items() if uid in rows]
        try:
            self._capture(bg, jobs)
        except Exception as exc:  # noqa: BLE001 - the rows go on; their chains start over
            self.checkpoints.generations.lost([j for j in jobs if j.snapshot is None], exc)
        finally:
            self._count(started)
        log.debug(  # bench/checkpoint_bench.py --engine-log-level debug
            "checkpoint capture phases (ms): capture %.2f (rows %d)",
            (time.perf_counter() - started) * 1e3,
            len(jobs),
        )

    def _capture(self, bg: BatchGenerator, jobs: list[Job]) -> None:
        self._due = {}
        together = self._cut_together(bg, jobs)
        for job in jobs:
            job.snapshot = together.get(job.uid, job.snapshot)
        jobs = [job for job in jobs if job.uid not in together]
        if not jobs:
            return
        extracted = bg.extract_cache([job.uid for job in jobs])
        for job in jobs:
            found = extracted.get(job.uid)
            if found is not None:
                job.snapshot = self.checkpoints.generations.capture(job, found[0])

    def _count(self, started: float) -> None:
        """The step loop's time on generation checkpoints since `started` (Stats)."""
        self.checkpoints.counters.add(capture_seconds=time.perf_counter() - started)

    def save_prefixes(self, bg: BatchGenerator) -> None:
        """Saves the prompts marked at their first token (after the step's events left, and
        before the batch steps again: a row still in the batch holds prompt + 1 token)."""
        due, self._prefixes_due = self._prefixes_due, []
        try:
            # Rows still in the batch are extracted together: each extraction syncs with
            # the step in flight, and a burst of new rows paid that once per row.
            in_batch = [item.job.uid for item in due if item.finished_cache is None]
            extracted = bg.extract_cache(in_batch) if in_batch else {}
            first = [i.job.uid for i in due if i.job.uid in extracted and first_snapshot_due(i.job)]
            pending = pending_tokens(bg, first) if first else {}
            ready: list[ReadySnapshot] = []
            on_own: set[int] = set()  # rows whose chains rest on the record saved below
            if pending:
                # The generations' first snapshots, right after their prefill, saved now with
                # the token the batch feeds next: a client gone before the next step (or an
                # engine killed) leaves a generation that resumes.
                started = time.perf_counter()
                jobs = [item.job for item in due if item.job.uid in pending]
                logging_rows = [j.uid for j in jobs if j.logprob_log is not None]
                if logging_rows:  # the snapshots' pages hold the pending tokens' entries
                    sampled_from = pending_logprobs(bg, logging_rows)
                    for job in jobs:
                        if job.uid in sampled_from:
                            job.note_pending(pending[job.uid], sampled_from[job.uid])
                ready, on_own = self._first_snapshots(bg, jobs, extracted, pending)
                self._count(started)
            chains = self.checkpoints.generations.chains
            for item in due:
                job, r = item.job, item.job.request
                found = extracted.get(job.uid)
                row = item.finished_cache or (found[0] if found is not None else None)
                if row is not None:  # None: the row left the batch meanwhile (parked)
                    # A chain resting on the record its prompt is saved as now rests on
                    # nothing if the store kept another engine's record instead (not the
                    # row's bytes).
                    on_exists = chains.breaker(job) if job.uid in on_own else None
                    self.checkpoints.prefixes.saves.save(
                        row, r.prompt, r.namespace, r.layout, r.prefix_record, on_exists
                    )
            if ready:
                # Queued behind the prompts' prefix records: a chain resting on one pins it
                # once it is in the store.
                started = time.perf_counter()
                self.checkpoints.generations.save_now(ready)
                self._count(started)
        except Exception as exc:  # noqa: BLE001 - the rows go on without these records
            self.checkpoints.generations.lost([item.job for item in due], exc)
        finally:
            self._release_if_idle()

    def _first_snapshots(
        self,
        bg: BatchGenerator,
        jobs: list[Job],
        extracted: dict[int, Any],
        pending: dict[int, int],
    ) -> tuple[list[ReadySnapshot], set[int]]:
        """First snapshots cut from the batch together, as a checkpoint round's are (one
        copy a layer and plane, one push), to be staged and queued with one wait: a burst of
        new rows saved row by row paid a capture, a push a tensor and a wait on the device
        each. Rows it cannot cut are captured from their extraction. Each chain rests on
        its prompt's prefix record where the store has (or is sent) the row's very bytes of
        those positions: the record its prompt is saved as now, or the one it restored.
        Also the uids of the rows resting on the record their prompt is saved as now."""
        gens, prefixes = self.checkpoints.generations, self.checkpoints.prefixes
        on_own = set()
        for job in jobs:
            r = job.request
            own = prefixes.saves.sent_as(r.prompt, r.namespace, r.layout, r.prefix_record)
            gens.chains.rest_on(job, ChainBase(own, len(r.prompt)) if own else job.restored_prefix)
            if own and job.chain.base is not None:
                on_own.add(job.uid)
        together = self._cut_together(bg, jobs)
        log.debug("first snapshots: %d of %d cut together", len(together), len(jobs))
        ready = [
            ReadySnapshot(
                job,
                together.get(job.uid) or gens.capture(job, extracted[job.uid][0]),
                pending[job.uid],
            )
            for job in jobs
        ]
        return ready, on_own

    def _cut_together(self, bg: BatchGenerator, jobs: list[Job]) -> dict[int, PendingSnapshot]:
        """The snapshots of the jobs the running batch's rows can be cut together for, by
        uid (segment_capture.py); the others are left untouched."""
        batch = running_batch(bg)
        if batch is None:
            return {}
        gens = self.checkpoints.generations
        return capture_together(gens, jobs, list(batch.uids), list(batch.prompt_cache))

    def expect_prefix(self, job: Job) -> None:
        """job's first token left before the step that reports it (first_tokens.py
        `_send_first_tokens`): a Flush asked now waits for its prefix too."""
        self._expected.add(id(job))
        self._hold()

    def forget(self, job: Job) -> None:
        """job will not reach its first token's report (it ended, or starts again)."""
        self._expected.discard(id(job))
        self._release_if_idle()

    def _hold(self) -> None:
        if not self._held:
            self._saving.acquire()
            self._held = True

    def _release_if_idle(self) -> None:
        if self._held and not self._prefixes_due and not self._expected:
            self._held = False
            self._saving.release()

    def queued_saves(self, timeout: float) -> bool:
        """Waits (any thread) until every prefix whose first token is out is queued for the
        store; False when that took longer than timeout."""
        if not self._saving.acquire(timeout=timeout):
            return False
        self._saving.release()
        return True


def first_snapshot_due(job: Job) -> bool:
    """A checkpointed generation at its first token with no snapshot taken yet."""
    return bool(job.checkpoint_key) and job.snapshot is None and not job.last_checkpoint_at
