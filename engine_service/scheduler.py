"""The engine loop: one thread owns every MLX call and drives mlx-lm's BatchGenerator.

gRPC handlers never touch MLX. They submit a request with a `sink` (a thread-safe callable
that takes a list of events) and may cancel it; the loop admits requests between decode
steps, steps the batch, and pushes each request's events to its sink: Started, Token per
generated token, and exactly one Finished. The loop never waits on the network.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from engine_service.checkpoints import MAX_CHAIN, CheckpointManager, PrefixPlan, ResumePlan
from engine_service.errors import AlreadyExists, Overloaded, Unavailable
from engine_service.events import Event, Finished, Sink, Started, Token
from engine_service.model import LoadedModel
from engine_service.quantized_kv import KVCodec, adopt_row
from engine_service.requests import GenerationRequest
from engine_service.sampling import make_processors, make_sampler, token_logprobs
from engine_service.speculative_lane import SpeculativeLane

log = logging.getLogger(__name__)


# Generation snapshots are taken on steps that are multiples of this (see _capture_due).
CHECKPOINT_ALIGN = 8
# How long the loop lingers for more arrivals before admitting new requests.
ADMISSION_WINDOW_S = float(os.environ.get("TANDEM_ADMISSION_WINDOW", "0.002"))

# Hands one step's events to their sinks; the server's version crosses into the event loop
# once per step rather than once per request.
Deliver = Callable[[list[tuple[Sink, list[Event]]]], None]


def deliver_directly(outbox: list[tuple[Sink, list[Event]]]) -> None:
    for sink, events in outbox:
        sink(events)


@dataclass
class Limits:
    max_running: int = 32
    max_queued: int = 256
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048


@dataclass
class _Job:
    request: GenerationRequest
    sink: Sink
    plan: PrefixPlan | ResumePlan | None = None
    uid: int = -1
    generated: int = 0
    stop_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)  # generated so far (resumed ones too)
    checkpoint_key: bytes = b""
    checkpointed: bool = False
    keep_checkpoint: bool = False  # a client that went away may come back and resume
    # A generation capture awaiting its pending token: (capture, tokens, segment or None).
    snapshot: tuple[Any, list[int], tuple[int, int, int] | None] | None = None
    last_checkpoint_at: int = 0  # len(tokens) at the last generation snapshot
    # Append-only checkpoint chain (plain KV caches): segments numbered so far, the first
    # live one, and how many cache positions the written segments cover.
    segment_count: int = 0
    segment_first: int = 0
    covered: int = 0
    admitted_at: float = 0.0


@dataclass
class EngineStats:
    running: int = 0
    queued: int = 0
    requests_total: int = 0
    generated_tokens_total: int = 0
    prompt_tokens_total: int = 0
    decode_tokens_per_second: float = 0.0
    batch_size: int = 0
    max_batch_size_seen: int = 0
    mean_batch_size: float = 0.0
    cancelled_total: int = 0
    rejected_total: int = 0
    steps_total: int = 0
    recent: collections.deque[tuple[float, int]] = field(
        default_factory=lambda: collections.deque(maxlen=256)
    )


class Scheduler:
    def __init__(
        self,
        loaded: LoadedModel,
        limits: Limits,
        deliver: Deliver = deliver_directly,
        checkpoints: CheckpointManager | None = None,
        draft: LoadedModel | None = None,
    ) -> None:
        self.loaded = loaded
        # Requests with num_draft_tokens run here, beside the batch (speculative_lane.py).
        self._speculative = SpeculativeLane(self, draft) if draft is not None else None
        self.checkpoints = checkpoints
        self.limits = limits
        self.deliver = deliver
        self._outbox: list[tuple[Sink, list[Event]]] = []
        self._due: dict[int, _Job] = {}  # rows whose generation checkpoint is due, by uid
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards admission counters and stats
        self._ids: set[str] = set()
        self._pending = 0  # submitted, not yet finished
        self._stats = EngineStats()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._rows: dict[int, _Job] = {}
        self._by_id: dict[str, _Job] = {}
        self._stopping = False
        self._accepting = True
        self._bg: BatchGenerator  # made on the engine thread: MLX streams are per thread
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)

    def _new_batch_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.loaded.model,
            completion_batch_size=self.limits.max_running,
            prefill_batch_size=min(self.limits.prefill_batch_size, self.limits.max_running),
            prefill_step_size=self.limits.prefill_step_size,
        )

    # -- called from other threads -----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(
        self, request: GenerationRequest, sink: Sink, plan: PrefixPlan | ResumePlan | None = None
    ) -> None:
        """Admits a request or raises Overloaded / AlreadyExists / Unavailable."""
        with self._lock:
            if not self._accepting:
                raise Unavailable("the engine is shutting down")
            if request.request_id in self._ids:
                raise AlreadyExists(f"request {request.request_id!r} is already running")
            limit = self.limits.max_running + self.limits.max_queued
            if self._pending >= limit:
                self._stats.rejected_total += 1
                raise Overloaded(
                    f"engine full: {self._pending} requests running or queued "
                    f"(--max-running {self.limits.max_running}, "
                    f"--max-queued {self.limits.max_queued})"
                )
            self._ids.add(request.request_id)
            self._pending += 1
            self._stats.requests_total += 1
        self._inbox.put(("submit", _Job(request, sink, plan)))

    def cancel(self, request_id: str, keep_checkpoint: bool = False) -> bool:
        """Asks the loop to stop a request; False if it is not known (already finished).

        keep_checkpoint: leave its generation checkpoint in the store, for a client that went
        away and may resume; otherwise it is deleted.
        """
        with self._lock:
            known = request_id in self._ids
        if known:
            self._inbox.put(("cancel", (request_id, keep_checkpoint)))
        return known

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def shutdown(self) -> None:
        """Cancels whatever is left and stops the loop."""
        self.stop_accepting()
        self._inbox.put(("stop", None))
        self._thread.join(30)

    def stats(self) -> EngineStats:
        with self._lock:
            s = self._stats
            now = time.monotonic()
            window = [(t, n) for t, n in s.recent if now - t <= 5.0]
            tps = 0.0
            if len(window) >= 2:
                span = window[-1][0] - window[0][0]
                tps = sum(n for _, n in window[1:]) / span if span > 0 else 0.0
            return EngineStats(
                running=s.running,
                queued=s.queued,
                requests_total=s.requests_total,
                generated_tokens_total=s.generated_tokens_total,
                prompt_tokens_total=s.prompt_tokens_total,
                decode_tokens_per_second=tps,
                batch_size=s.batch_size,
                max_batch_size_seen=s.max_batch_size_seen,
                mean_batch_size=s.generated_tokens_total / s.steps_total if s.steps_total else 0,
                cancelled_total=s.cancelled_total,
                rejected_total=s.rejected_total,
                steps_total=s.steps_total,
            )

    # -- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        self._bg = self._new_batch_generator()
        while True:
            idle = not self._rows and not self._waiting and not self._speculating()
            waiting_before = len(self._waiting)
            if not self._drain_inbox(block=idle):
                break
            arrived = len(self._waiting) > waiting_before
            room = self._running() + len(self._waiting) < self.limits.max_running
            if arrived and room and ADMISSION_WINDOW_S:
                # A burst of requests arrives over a few milliseconds: gather it so it is
                # prefilled as one batch, not one request per decode step.
                time.sleep(ADMISSION_WINDOW_S)
                if not self._drain_inbox(block=False):
                    break
            self._admit()
            self._expire_deadlines()
            if self._rows:
                self._step()
            if self._speculating():
                self._step_speculative()
            self._publish_counts()
            self._flush_outbox()
        self._cancel_all("the engine is shutting down")
        self._flush_outbox()

    def _emit(self, job: _Job, events: list[Event]) -> None:
        self._outbox.append((job.sink, events))

    def _flush_outbox(self) -> None:
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            self.deliver(outbox)

    def _drain_inbox(self, block: bool) -> bool:
        """Applies queued commands; False when asked to stop."""
        while True:
            try:
                kind, arg = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return True
            block = False
            if kind == "submit":
                self._waiting.append(arg)
                self._by_id[arg.request.request_id] = arg
            elif kind == "cancel":
                request_id, keep = arg
                if request_id in self._by_id:
                    self._by_id[request_id].keep_checkpoint = keep
                self._cancel(request_id)
            elif kind == "stop":
                return False

    def _running(self) -> int:
        return len(self._rows) + (len(self._speculative) if self._speculative else 0)

    def _speculating(self) -> bool:
        return bool(self._speculative and len(self._speculative))

    def _step_speculative(self) -> None:
        assert self._speculative is not None
        produced = self._speculative.step()
        with self._lock:
            self._stats.generated_tokens_total += produced
            self._stats.recent.append((time.monotonic(), produced))

    def _admit(self) -> None:
        free = self.limits.max_running - self._running()
        batch = []
        while free > 0 and self._waiting:
            job = self._waiting.popleft()
            free -= 1
            if job.request.num_draft and self._speculative is not None:
                self._prepare(job)
                self._speculative.admit(job)
            else:
                batch.append(job)
        if not batch:
            return
        prompts, histories, caches, max_tokens = [], [], [], []
        samplers, processors, stops = [], [], []
        for job in batch:
            r = job.request
            self._prepare(job)
            prompt, history, cache, cached = self._starting_point(job)
            prompts.append(prompt)
            histories.append(history)
            caches.append(self._row_caches(cache, r.kv))
            max_tokens.append(r.max_tokens - len(job.tokens))
            samplers.append(make_sampler(r.sampling, start_step=len(job.tokens)))
            processors.append(make_processors(r.sampling))
            stops.append(StopSequences([[t] for t in sorted(job.stop_ids)]))
            job.generated = len(job.tokens)
            self._emit(job, [Started(len(r.prompt), cached)])
        uids = self._bg.insert(
            prompts,
            max_tokens=max_tokens,
            caches=caches,
            all_tokens=histories,
            samplers=samplers,  # type: ignore[arg-type]  # None = the shared greedy one
            logits_processors=processors,
            stop_sequences=stops,
        )
        for job, uid in zip(batch, uids, strict=True):
            job.uid = uid
            self._rows[uid] = job
        with self._lock:
            self._stats.prompt_tokens_total += sum(len(p) for p in prompts)

    def _prepare(self, job: _Job) -> None:
        """What every admitted request needs: its stop ids and checkpoint key."""
        r = job.request
        stop_ids = set(r.sampling.stop_token_ids)
        if not r.sampling.ignore_eos:
            stop_ids.update(self.loaded.eos_token_ids)
        job.stop_ids = frozenset(stop_ids)
        job.admitted_at = time.monotonic()
        ckpt = self.checkpoints
        if ckpt is not None and ckpt.has_store and r.checkpoint_interval:
            job.checkpoint_key = ckpt.generation_key(
                r.namespace, r.prompt, r.sampling, r.request_id, r.layout
            )

    def _row_caches(self, restored: list[Any] | None, kv: KVCodec) -> list[Any]:
        """A request's per-layer caches, its plain KV layers as rows of a
        BatchQuantizedKVCache carrying its codec (plain requests too: any two requests may
        then share a batch)."""
        caches = restored if restored is not None else make_prompt_cache(self.loaded.model)
        return [adopt_row(c, kv) for c in caches]

    def _starting_point(self, job: _Job) -> tuple[list[int], list[int], Any, int]:
        """(tokens to feed, tokens already in the cache, cache or None, cached prompt tokens),
        restoring the job's checkpoint when it has one."""
        r, plan, ckpt = job.request, job.plan, self.checkpoints
        if isinstance(plan, ResumePlan) and ckpt is not None:
            # The restored cache holds prompt + generated; the pending token is fed next and
            # the sampler goes on at the step after it.
            job.tokens = [*plan.generated, plan.pending]
            job.last_checkpoint_at = len(job.tokens)
            # Go on with the chain the checkpoint belongs to.
            job.segment_count = int(plan.meta.get("segments_next", 0))
            job.segment_first = int(plan.meta.get("segments_first", 0))
            job.covered = len(r.prompt) + len(plan.generated)
            job.checkpointed = True
            history = [*r.prompt, *plan.generated]
            return [plan.pending], history, ckpt.materialize_resume(plan), len(r.prompt)
        if isinstance(plan, PrefixPlan) and ckpt is not None:
            cache = ckpt.materialize_prefix(plan)
            if cache is not None:
                return r.prompt[plan.matched :], r.prompt[: plan.matched], cache, plan.matched
        return r.prompt, [], None, 0

    def _step(self) -> None:
        try:
            _, responses = self._bg.next()
        except Exception as exc:  # a model failure must not take the engine down silently
            log.exception("batch step failed; failing its requests")
            self._fail_all(f"generation failed: {exc}")
            return
        if not responses:
            return
        want = [(r, self._rows.get(r.uid)) for r in responses]
        logprob_rows = [(r, job) for r, job in want if job and job.request.sampling.logprobs >= 0]
        extras = self._logprobs(logprob_rows) if logprob_rows else {}
        for r, job in want:
            if job is None:
                continue  # removed (cancelled) while its token was in flight
            job.generated += 1
            job.tokens.append(r.token)
            lp, top = extras.get(r.uid, (None, None))
            events: list[Event] = [Token(r.token, lp, top)]
            if self.checkpoints is not None:
                self._checkpoint(job, r.prompt_cache if r.finish_reason is not None else None)
            if r.finish_reason is not None:
                stop = r.token if r.finish_reason == "stop" else None
                events.append(Finished("stop" if stop is not None else "length", stop_token=stop))
                self._forget(job)
            self._emit(job, events)
        if self.checkpoints is not None:
            self._capture_due()
        with self._lock:
            s = self._stats
            s.generated_tokens_total += len(responses)
            s.steps_total += 1
            s.batch_size = len(responses)
            s.max_batch_size_seen = max(s.max_batch_size_seen, len(responses))
            s.recent.append((time.monotonic(), len(responses)))

    def _logprobs(
        self, rows: list[tuple[Any, _Job]]
    ) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """The sampled token's logprob and the top-n alternatives, per row that asked."""
        out = {}
        for r, job in rows:
            out[r.uid] = token_logprobs(r.logprobs, r.token, job.request.sampling.logprobs)
        return out

    def _checkpoint(self, job: _Job, finished_cache: list[Any] | None) -> None:
        """After a token: the prompt's prefix (first token), the generation every N tokens.

        A generation snapshot is taken when its N-th token is out, but only queued one step
        later: the token sampled in between is the checkpoint's pending token (sampled, not
        yet fed), known then without forcing the batch's look-ahead to finish early.
        """
        ckpt = self.checkpoints
        assert ckpt is not None
        r = job.request
        if job.snapshot is not None:
            captured, tokens, segment = job.snapshot
            job.snapshot = None
            if finished_cache is None:  # a finishing job deletes its checkpoint anyway
                ckpt.save_generation(
                    job.checkpoint_key,
                    r.namespace,
                    captured,
                    r.prompt,
                    tokens,
                    job.tokens[-1],
                    r.sampling,
                    r.max_tokens,
                    r.layout,
                    segment,
                )
                job.checkpointed = True
        if len(job.tokens) == 1 and not isinstance(job.plan, ResumePlan):
            ckpt.add_prefill_time(time.monotonic() - job.admitted_at)
            row = finished_cache or self._row_cache(job)
            if row is not None:
                ckpt.save_prefix(row, r.prompt, r.namespace, r.layout)
        since = len(job.tokens) - job.last_checkpoint_at
        if job.checkpoint_key and finished_cache is None and since >= r.checkpoint_interval:
            self._due[job.uid] = job

    def _capture_due(self) -> None:
        """Snapshots every row whose checkpoint is due, together, on aligned steps.

        Extracting a row from mlx-lm's batch cache evaluates the batch's padding, a sync with
        the step in flight; rows captured one at a time paid it each (~11% of decode at 8
        streams every 16 tokens), rows captured together pay it once (~4%). A checkpoint is
        therefore up to CHECKPOINT_ALIGN - 1 tokens later than its interval.
        """
        ckpt = self.checkpoints
        if not self._due or ckpt is None or self._stats.steps_total % CHECKPOINT_ALIGN:
            return
        jobs = [job for uid, job in self._due.items() if uid in self._rows]
        self._due = {}
        rows = self._bg.extract_cache([job.uid for job in jobs])
        for job in jobs:
            found = rows.get(job.uid)
            if found is None:
                continue
            held = len(job.request.prompt) + len(job.tokens)
            segment = None
            start = 0
            if ckpt.segmentable(job.request.layout):
                # Append what is new since the last segment; start over when there is no
                # chain yet, it is long (MAX_CHAIN) or it has a hole (a segment dropped).
                if (
                    job.segment_count == 0
                    or job.covered == 0
                    or job.segment_count - job.segment_first >= MAX_CHAIN
                    or ckpt.chain_broken(job.checkpoint_key)
                ):
                    job.segment_first = job.segment_count
                else:
                    start = job.covered
                segment = (job.segment_count, job.segment_first, start)
                job.segment_count += 1
                job.covered = held
            captured = ckpt.capture_generation(found[0], held, start)
            job.snapshot = (captured, list(job.tokens), segment)
            job.last_checkpoint_at = len(job.tokens)

    def _row_cache(self, job: _Job) -> list[Any] | None:
        found = self._bg.extract_cache([job.uid]).get(job.uid)
        return found[0] if found is not None else None

    def _cancel(self, request_id: str, reason: str = "cancelled", error: str = "") -> None:
        job = self._by_id.get(request_id)
        if job is None:
            return
        if job.uid >= 0:
            self._bg.remove([job.uid])
        elif self._speculative is not None and request_id in self._speculative.jobs:
            self._speculative.remove(request_id)
        else:
            self._waiting.remove(job)
        self._forget(job)
        with self._lock:
            self._stats.cancelled_total += 1
        self._emit(job, [Finished(reason, error=error)])

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for job in list(self._by_id.values()):
            if job.request.deadline is not None and now > job.request.deadline:
                self._cancel(job.request.request_id, "deadline", "deadline exceeded")

    def _forget(self, job: _Job) -> None:
        if job.checkpointed and not job.keep_checkpoint and self.checkpoints is not None:
            self.checkpoints.forget_generation(
                job.checkpoint_key, job.request.namespace, job.segment_count
            )
        self._rows.pop(job.uid, None)
        self._by_id.pop(job.request.request_id, None)
        with self._lock:
            self._ids.discard(job.request.request_id)
            self._pending -= 1

    def _fail_all(self, message: str) -> None:
        for job in list(self._by_id.values()):
            self._forget(job)
            self._emit(job, [Finished("error", error=message)])
        self._waiting.clear()
        if self._speculative is not None:
            self._speculative.clear()
        self._bg = self._new_batch_generator()

    def _cancel_all(self, message: str) -> None:
        for request_id in list(self._by_id):
            self._cancel(request_id, "cancelled", message)

    def _publish_counts(self) -> None:
        with self._lock:
            self._stats.running = self._running()
            self._stats.queued = len(self._waiting)
