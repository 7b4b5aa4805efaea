"""Generation checkpoints: snapshots of a running generation, saved, resumed and forgotten.

Every `checkpoint_interval` tokens the MLX thread captures a row's caches; one step later,
when the token sampled in between (the pending token) is known, the snapshot is queued for
the store, pinned while the generation runs, and deleted when it ends.

Caches made only of plain KV layers grow only at the end, so a snapshot can hold just the
positions added since the last one: such snapshots are *segments* of an append-only chain
(checkpoints/chain_policy.py says what each holds), each its own record saying the
generation's state when it was taken; a small *manifest* under the generation key, written
with each run's first segment, names the run, the chain's settled parts before it and the
prefix record it rests on. Other layouts store a whole snapshot under the generation key
each time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_lm.models import cache as cache_lib

from engine_service.checkpoints.attachments import CapturedAttachment
from engine_service.checkpoints.cache_records import (
    STACKED_CODEC_VERSION,
    CapturedCache,
    capture,
    settle_all,
)
from engine_service.checkpoints.chain_policy import ChainPolicy
from engine_service.checkpoints.chain_tokens import TOKENS_BEFORE, digest_before, tokens_between
from engine_service.checkpoints.device_landing import Landing
from engine_service.checkpoints.generation_loads import GenerationLoads
from engine_service.checkpoints.generation_meta import (
    BASED_CODEC_VERSION,
    ENDED,
    GenerationMeta,
    mode_of,
    options_digest,
    segment_key,
    segmentable,
)
from engine_service.checkpoints.host_staging import HostStaging, Staged
from engine_service.checkpoints.logprob_pages import LogprobLog
from engine_service.checkpoints.spill import SpillQueue
from engine_service.checkpoints.spill_items import Put
from engine_service.device_memory import cache_given_back
from engine_service.loop.jobs import Job, PendingSnapshot, ReadySnapshot, Segment
from engine_service.protocol.checkpoint_stats import CheckpointCounters
from engine_service.protocol.sampling_options import SamplingOptions
from tandem_client.identity import generation_key, scope_digest
from tandem_client.records import Checkpoint, Tensor
from tandem_client.regions import RegionHold
from tandem_client.store_client import StoreClient

log = logging.getLogger(__name__)


@dataclass
class _Round:
    """A step's snapshots, staged as host bytes, waiting to be queued (complete_round)."""

    ready: list[ReadySnapshot]
    staged: Staged


class GenerationCheckpoints:
    def __init__(
        self,
        model_id: str,
        counters: CheckpointCounters,
        store: StoreClient | None = None,
        spill: SpillQueue | None = None,
        staging: HostStaging | None = None,
    ) -> None:
        self.model_id = model_id
        self.counters = counters
        self.store = store
        self.spill = spill
        # How captures become host bytes (through the store's region when attached).
        self.staging = staging if staging is not None else HostStaging(Landing(), None)
        self.loads = GenerationLoads(model_id, counters, store, self.staging.landing)
        self.chains = ChainPolicy(spill)  # what each snapshot of a chain holds
        self._round: _Round | None = None  # staged by save_round, queued at the next step

    def key(
        self,
        namespace: str,
        prompt: list[int],
        options: SamplingOptions,
        request_id: str,
        layout: list[str],
    ) -> bytes:
        # Both modes find a generation's key: the record's model id then refuses the other
        # mode by name (load), rather than a NOT_FOUND that names neither.
        scope = scope_digest(mode_of(self.model_id)[0], layout, namespace)
        return generation_key(scope, prompt, options_digest(options), request_id)

    # -- the MLX thread ----------------------------------------------------------------------

    def enroll(self, job: Job) -> None:
        """Gives an admitted job its checkpoint key when it asked for checkpoints."""
        r = job.request
        if self.spill is not None and r.checkpoint_interval:
            job.checkpoint_key = self.key(r.namespace, r.prompt, r.sampling, r.request_id, r.layout)
            job.options_digest = options_digest(r.sampling).hex()  # once, not every round
            if r.sampling.logprobs >= 0 and job.logprob_log is None:
                job.logprob_log = LogprobLog()  # a resumed one's comes with its plan

    @staticmethod
    def due(job: Job) -> bool:
        """Whether a running job's next snapshot is due: N tokens since its last one."""
        since = len(job.tokens) - job.last_checkpoint_at
        return bool(job.checkpoint_key) and since >= job.request.checkpoint_interval

    def capture(self, job: Job, row_caches: list[Any]) -> PendingSnapshot:
        """Starts a snapshot of a batch row (no wait: the copies run with the next step)."""
        held = self.held(job)
        segment = None
        if segmentable(job.request.layout):
            segment = self.next_segment(job)
            row_caches = _positions(row_caches, segment.start)
        return self.pending(job, capture(row_caches, held, wait=False), segment)

    @staticmethod
    def held(job: Job) -> int:
        """The positions a running job's caches hold."""
        return len(job.request.prompt) + len(job.tokens)

    @staticmethod
    def pending(job: Job, captured: CapturedCache, segment: Segment | None) -> PendingSnapshot:
        """A capture taken now, waiting for its pending token."""
        job.last_checkpoint_at = len(job.tokens)
        return PendingSnapshot(captured, list(job.tokens), segment)

    def capture_whole(
        self, job: Job, caches: list[Any], attachments: list[CapturedAttachment]
    ) -> PendingSnapshot:
        """A whole snapshot whose pending token is known already (the last of job.tokens)."""
        held = len(job.request.prompt) + len(job.tokens) - 1
        job.last_checkpoint_at = len(job.tokens)
        captured = capture(caches, held, wait=False)
        return PendingSnapshot(captured, job.tokens[:-1], None, list(attachments))

    def next_segment(self, job: Job) -> Segment:
        """What a segmentable job's next snapshot holds (it advances the chain: capture it)."""
        return self.chains.next_segment(job, self.held(job))

    def save_parked(self, job: Job, snapshot: PendingSnapshot) -> bool:
        """A parked row's whole snapshot, its pending token the last of job.tokens (MLX
        thread); False when it is not queued. Its chain starts over after it."""
        if not job.checkpoint_key:
            return False
        job.chain.covered = 0
        return self.save(job, snapshot, pending=job.tokens[-1])

    def save(self, job: Job, snapshot: PendingSnapshot, pending: int) -> bool:
        """Queues a snapshot for the store once its pending token is known (MLX thread);
        False when it is not queued."""
        return self.save_now([ReadySnapshot(job, snapshot, pending)])[0]

    def save_now(self, ready: list[ReadySnapshot]) -> list[bool]:
        """`save` for several snapshots, staged together and queued before it returns (one
        wait on the device for all); per snapshot whether it is queued."""
        self.complete_round()
        if self.spill is None or not ready:
            return [False] * len(ready)
        staged = None
        try:
            staged = self._staged(ready)
            staged.wait()
        except Exception as exc:  # noqa: BLE001 - lost snapshots, not the engine loop
            if staged is not None:
                staged.release()
            self.lost([r.job for r in ready], exc)
            return [False] * len(ready)
        return [
            self._queue(r.job, r.snapshot, r.pending, tensors, keep)
            for r, (tensors, keep) in zip(ready, staged.tensors, strict=True)
        ]

    @property
    def round_staged(self) -> bool:
        """A round is staged, to be queued at the next step (complete_round)."""
        return self._round is not None

    def save_round(self, ready: list[ReadySnapshot]) -> None:
        """`save` for the snapshots a step made ready, staged as host bytes together and
        queued one step later (complete_round): on MLX-CUDA the round's push into the region
        is then waited on once the step behind it has run, not while the next step is
        queued ahead of it (a bubble in the pipeline each round)."""
        self.complete_round()
        if self.spill is None or not ready:
            return
        for r in ready:
            r.job.checkpointed = True  # its checkpoint is on its way: forget it if it ends
        started = time.perf_counter()
        try:
            self._round = _Round(ready, self._staged(ready))
        except Exception as exc:  # noqa: BLE001 - lost snapshots, not the engine loop
            self.lost([r.job for r in ready], exc)
            return
        log.debug(  # where a round's time on the MLX thread goes (bench/checkpoint_bench.py)
            "checkpoint round phases (ms): stage %.2f (rows %d)",
            (time.perf_counter() - started) * 1e3,
            len(ready),
        )

    def complete_round(self) -> None:
        """Queues the round staged last (MLX thread). Every write of this class calls it
        first, and the loop once a step and whenever a job ends, so the order in which
        records reach the store is the order they were saved in."""
        round_, self._round = self._round, None
        if round_ is None:
            return
        started = time.perf_counter()
        try:
            round_.staged.wait()
        except Exception as exc:  # noqa: BLE001 - lost snapshots, not the engine loop
            round_.staged.release()
            self.lost([r.job for r in round_.ready], exc)
            return
        waited = time.perf_counter()
        for r, (tensors, keep) in zip(round_.ready, round_.staged.tensors, strict=True):
            self._queue(r.job, r.snapshot, r.pending, tensors, keep)
        log.debug(
            "checkpoint round phases (ms): wait %.2f, queue %.2f (rows %d)",
            (waited - started) * 1e3,
            (time.perf_counter() - waited) * 1e3,
            len(round_.ready),
        )

    def lost(self, jobs: list[Job], failure: Exception) -> None:
        """Snapshots cut but never queued (their capture, copy or push raised: a device out of
        memory, ...). Each job's live run is marked broken, so its next snapshot starts the
        chain over instead of building on the hole (a resume never reads a chain missing a
        segment); its row goes on. Counted as failed saves."""
        log.error(
            "%d generation snapshots lost (%s); their chains start over at the next snapshot",
            len(jobs),
            failure,
            exc_info=failure,
        )
        cache_given_back(failure)
        self.counters.add(failed=max(1, len(jobs)))
        for job in jobs:
            if job.checkpoint_key:
                self.chains.breaker(job)()

    def _staged(self, ready: list[ReadySnapshot]) -> Staged:
        settle_all(
            [r.snapshot.captured for r in ready]
            + [a.captured for r in ready for a in r.snapshot.attachments]
        )
        return self.staging.tensors_many([r.snapshot.captured for r in ready])

    def _queue(
        self,
        job: Job,
        snapshot: PendingSnapshot,
        pending: int,
        tensors: list[Tensor],
        keep: RegionHold | None,
    ) -> bool:
        assert self.spill is not None
        r, key = job.request, job.checkpoint_key
        captured, segment = snapshot.captured, snapshot.segment
        meta = GenerationMeta(
            prompt_tokens=len(r.prompt),
            generated=len(snapshot.generated),
            pending=pending,
            seed=r.sampling.seed,
            max_tokens=r.max_tokens,
            options=job.options_digest or options_digest(r.sampling).hex(),
            # A segment's and its manifest's: the chain's live segments then.
            chain_first=None if segment is None else segment.first,
            chain_next=None if segment is None else segment.index + 1,
            chain_parts=() if segment is None else segment.parts,
            chain_base=None if segment is None else segment.base,
        )
        job.checkpointed = True
        if segment is None:
            # Its pages first: a snapshot whose pages did not land is not sent (a resume would
            # find entries of an older run there).
            pages_landed = self._put_logprob_pages(job)
            record = self._record(job, key, "generation", [*r.prompt, *snapshot.generated])
            record.metadata = {**meta.to_metadata(), **captured.meta()}
            record.tensors = tensors
            record.attachments = [a.to_record() for a in snapshot.attachments]
            nbytes = captured.nbytes + sum(a.nbytes for a in snapshot.attachments)
            return self.spill.put(Put(record, nbytes, keep=keep, still_wanted=pages_landed))
        # A segment carries the generation's state when it was taken (its tokens, pending
        # token, chain): a chain's later segments have no manifest of their own.
        part = self._record(job, segment_key(key, segment.index), "object", [])
        chained = meta.to_metadata()
        part.metadata = {
            **captured.meta(),
            **chained,
            "segment_of": key.hex(),
            "start": str(segment.start),
        }
        part.tensors = tensors
        items = [part]
        if segment.start == 0 and segment.base is None:
            part.token_ids = [*r.prompt, *snapshot.generated]  # a whole snapshot: all of them
        else:
            # Its positions' tokens, and a digest of those before them.
            held = len(r.prompt) + len(snapshot.generated)
            part.token_ids = tokens_between(r.prompt, snapshot.generated, segment.start, held)
            part.metadata[TOKENS_BEFORE] = digest_before(
                job.chain.tokens, r.prompt, snapshot.generated, segment.start
            )
        if segment.index == segment.first:
            # A run's first segment: the manifest naming it (and the parts before it) goes
            # right after.
            record = self._record(job, key, "generation", [*r.prompt, *snapshot.generated])
            record.metadata = {
                **chained,
                # Its segments' (each names its own; a manifest naming parts says the newer
                # codec, so that an engine that predates both refuses it by name).
                "codec": _manifest_codec(segment, part.metadata["codec"]),
                "layout": "|".join(r.layout),
            }
            items.append(record)

        wanted, broke = self.chains.hooks(key, segment.first)
        # Its pages before it, as part of its run: one that does not land breaks the run.
        self._put_logprob_pages(job, on_failed=broke)
        if segment.base is not None and segment.index == segment.first and not segment.parts:
            self.chains.pin(job, segment.first)  # a chain (re)starting over its base: leased first

        # The segment first, then the manifest naming it: a manifest never lists a segment
        # that is not stored. Only a run's first segment has one: a later segment is found
        # by its index and says itself what state it holds, so a round costs the store one
        # record a row, not two (load reads the run on from the manifest).
        for item in items:
            nbytes = captured.nbytes if item is part else 0
            span = keep if item is part else None
            if not self.spill.put(
                Put(item, nbytes, still_wanted=wanted, on_failed=broke, keep=span)
            ):
                broke()
                return False
        # What this run's manifest made dead, once it landed (not sent otherwise: the
        # manifest still in the store names them).
        for index in segment.dead:
            self.spill.delete(segment_key(key, index), r.namespace, still_wanted=wanted)
        return True

    def _put_logprob_pages(
        self, job: Job, pinned: bool = True, on_failed: Callable[[], None] | None = None
    ) -> Callable[[], bool]:
        """Queues job's logprob pages not in the store yet (LogprobLog.queue_pages)."""
        assert self.spill is not None
        if job.logprob_log is None:
            return lambda: True
        r = job.request
        return job.logprob_log.queue_pages(
            self.spill, job.checkpoint_key, r.namespace, self.model_id, r.layout, pinned, on_failed
        )

    def _record(self, job: Job, key: bytes, kind: str, token_ids: list[int]) -> Checkpoint:
        r = job.request
        return Checkpoint(
            key=key,
            kind=kind,
            namespace=r.namespace,
            model_id=self.model_id,
            layout=r.layout,
            token_ids=list(token_ids),
            trimmable=False,
        )

    def forget(self, job: Job) -> None:
        """An ended generation: its checkpoint becomes a small tombstone under the same key
        (so a resume answers "finished; N tokens", not NOT_FOUND) and every segment goes.

        The tombstone is an unpinned metadata-only "object" record once the generation's
        lease lapses: it lives until the store's LRU evicts it, and is not listed among the
        generations in flight.
        """
        self.complete_round()
        if self.spill is None:
            return
        key, namespace, spill = job.checkpoint_key, job.request.namespace, self.spill
        tombstone = self._record(job, key, "object", [*job.request.prompt, *job.tokens])
        tombstone.metadata = {
            ENDED: job.ended,
            "prompt_tokens": str(len(job.request.prompt)),
            "generated": str(len(job.tokens)),
        }
        # The tombstone first, replacing the manifest: a resume then finds it, or a manifest
        # whose segments are all still there (load() re-reads the key when one went missing).
        # If it cannot land, the manifest is deleted instead.
        self._put_logprob_pages(job, pinned=False)  # a finished one's tail is replayed
        spill.put(Put(tombstone, 0, pinned=False, on_failed=lambda: spill.delete(key, namespace)))
        for index in range(job.chain.next_index):
            self.spill.delete(segment_key(key, index), namespace)
        self.chains.forget(job)


def _manifest_codec(segment: Segment, records: str) -> str:
    """What a run's manifest says reading it needs: a chain resting on a base, or naming
    settled parts, says a codec that engines predating them refuse by name."""
    if segment.base is not None:
        return BASED_CODEC_VERSION
    return STACKED_CODEC_VERSION if segment.parts else records


def _positions(row_caches: list[Any], start: int) -> list[Any]:
    """Positions [start, offset) of plain KV caches, as caches of their own (no copy yet)."""
    if not start:
        return row_caches
    segment = []
    for cache in row_caches:
        part = cache_lib.KVCache()
        part.keys = cache.keys[..., start : cache.offset, :]
        part.values = cache.values[..., start : cache.offset, :]
        part.offset = cache.offset - start
        segment.append(part)
    return segment
