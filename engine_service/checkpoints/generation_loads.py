"""Resuming a generation: its checkpoint read from the store and checked against the request
(the planning pool), then its caches rebuilt (the MLX thread).

A whole snapshot is one record under the generation key. A chain (docs/checkpoints.md) is a
manifest under that key, written with the chain's first segment and naming it, then the
segments written after it, each found by its index and saying itself the generation's state
when it was taken (its tokens, pending token): the resume reads the manifest, then the
chain's segments as far as they run on without a gap, each continuing the one before.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as cache_lib

from engine_service.checkpoints.attachments import check_attachment
from engine_service.checkpoints.attachments import find as find_attachment
from engine_service.checkpoints.cache_records import check_restorable, restore
from engine_service.checkpoints.chain_reads import (
    HeldSegment,
    base_of,
    continuing,
    gapless,
    header_of,
    held_base_of,
    segments_of,
    settled_before,
    start_of,
    tokens_after,
)
from engine_service.checkpoints.chain_tokens import TokenDigest
from engine_service.checkpoints.device_landing import Landing
from engine_service.checkpoints.generation_meta import (
    MAX_CHAIN,
    ChainBase,
    GenerationMeta,
    model_refusal,
    refuse_ended,
    segment_key,
)
from engine_service.core.plans import ResumePlan
from engine_service.errors import Corrupt, EngineError, NotFound, Precondition, Unavailable
from engine_service.kv.batch_cache import BatchQuantizedKVCache
from engine_service.protocol.checkpoint_stats import CheckpointCounters
from tandem_client.errors import DataLoss, TandemError
from tandem_client.errors import NotFound as StoreNotFound
from tandem_client.records import Checkpoint, HeaderRead
from tandem_client.regions import RegionHold
from tandem_client.store_client import StoreClient

log = logging.getLogger(__name__)


class GenerationLoads:
    def __init__(
        self,
        model_id: str,
        counters: CheckpointCounters,
        store: StoreClient | None,
        landing: Landing | None = None,
    ) -> None:
        self.model_id = model_id
        self.counters = counters
        self.store = store
        # How a segment's bytes, left in the shared-memory region, become arrays: pulled by
        # the GPU from the pinned region on MLX-CUDA (43 GB/s against mx.array's 2.4), one
        # host copy elsewhere.
        self.landing = landing if landing is not None else Landing()

    def materialize(self, plan: ResumePlan) -> list[Any]:
        """The caches of a resume plan (MLX thread): the whole snapshot, or the chain's
        segments joined in order. The plan's region spans are given back once the arrays
        own their bytes."""
        start = time.perf_counter()
        try:
            caches = self._joined(plan)
            joined = time.perf_counter()
            self.landing.settle()
        finally:
            plan.release()
        done = time.perf_counter()
        self.counters.observe_restore(plan.nbytes, plan.fetch_s + done - start)
        log.debug(
            "resume restore phases (ms): land and join %.1f, settle %.1f (MiB %d)",
            (joined - start) * 1e3,
            (done - joined) * 1e3,
            plan.nbytes >> 20,
        )
        return caches

    def _joined(self, plan: ResumePlan) -> list[Any]:
        if not plan.chain_next:
            (whole,) = plan.parts
            return self._restored(whole, plan.layout)
        parts = [self._restored(p, plan.layout) for p in plan.parts]
        if plan.base is not None:  # the prompt's record: the positions the chain rests on
            for cache in parts[0]:
                cache.offset = plan.base.tokens
        caches = []
        for layer in zip(*parts, strict=True):
            # Joined with a batch step of zero columns after them, in the same copy: the
            # batch takes a lone resumed row's planes as they are (kv/planes.py).
            cache = cache_lib.KVCache()
            cache.keys = _joined_with_room([(p.keys, p.offset) for p in layer])
            cache.values = _joined_with_room([(p.values, p.offset) for p in layer])
            cache.offset = sum(p.offset for p in layer)
            caches.append(cache)
        return caches

    def _restored(self, part: Checkpoint, layout: list[str]) -> list[Any]:
        """A record's caches, its tensors landed together (one pull on MLX-CUDA)."""
        arrays = self.landing.arrays(part.tensors)
        return restore(part.metadata, part.tensors, layout, lambda t: arrays[id(t)])

    def load(
        self,
        key: bytes,
        namespace: str,
        prompt: list[int],
        layout: list[str],
        companions: dict[str, dict[str, str]] | None = None,
    ) -> ResumePlan:
        """The checkpoint of a generation to resume, checked against the request.

        companions: attachment schema -> metadata it must carry (e.g. the draft model); the
        ones present are checked here (FAILED_PRECONDITION) and kept in the plan.
        """
        if self.store is None:
            raise Precondition("resume needs an engine started with --store")
        start = time.perf_counter()
        record, candidates = self._manifest(key, namespace)
        manifest_read = time.perf_counter()
        refuse_ended(record)
        if record.model_id != self.model_id:
            raise Precondition(model_refusal(record.model_id, self.model_id))
        if list(record.layout) != layout:
            raise Precondition(
                f"checkpoint cache layout {list(record.layout)} differs from the request's {layout}"
            )
        meta = GenerationMeta.from_metadata(record.metadata)
        if record.token_ids[: meta.prompt_tokens] != list(prompt):
            raise Precondition("checkpoint prompt differs from the request's")
        parts, tokens = [record], list(record.token_ids)
        holds: list[RegionHold] = []
        chain_read = manifest_read
        settled, base, run_start = meta.chain_parts, meta.chain_base, 0
        try:
            if meta.chain_first is not None and meta.chain_next is not None:
                first, listed = meta.chain_first, meta.chain_next
                headers = candidates if first == 0 and not settled and not base else None
                try:
                    held = self._chain(
                        key, namespace, first, listed, tokens, headers, settled, base
                    )
                except NotFound:
                    self._refuse_if_ended(key, namespace)  # it may have ended meanwhile
                    raise
                chain_read = time.perf_counter()
                parts = [part.checkpoint for part in held]
                holds = [part.hold for part in held if part.hold is not None]
                if base is not None:
                    held = held[1:]  # the chain's own segments, after its base
                    if parts[0].model_id != self.model_id:
                        raise Corrupt("the prefix record a checkpoint rests on is another model's")
                run_start = start_of(held[len(settled)])
                # After the settled parts and the run's segments the manifest names.
                later = held[len(settled) + meta.chain_next - meta.chain_first :]
                digest = TokenDigest()
                for segment in later:
                    meta = GenerationMeta.from_metadata(segment.metadata)  # each says its state
                    after = tokens_after(tokens, digest, segment)
                    if after is None:  # _chain read it as continuing: never
                        raise Corrupt("a checkpoint segment does not continue its chain")
                    tokens = after
                if later:
                    self._refuse_if_ended(key, namespace)  # a tombstone replaced the manifest
            ended_checked = time.perf_counter()
            # Refuse here, with a status, what the MLX thread could not restore.
            for part in parts:
                check_restorable(part.metadata, part.tensors, layout)
            kept = []
            for schema, expect in (companions or {}).items():
                attachment = find_attachment(record.attachments, schema)
                if attachment is not None:
                    check_attachment(attachment, schema, len(record.token_ids), expect)
                    kept.append(attachment)
        except BaseException:
            for hold in holds:
                hold.release()
            raise
        self.counters.add(resumes=1)
        done = time.perf_counter()
        log.debug(  # bench/checkpoint_bench.py --engine-log-level debug prints these
            "resume load phases (ms): manifest %.1f, chain %.1f, ended %.1f, checks %.1f "
            "(segments %d)",
            (manifest_read - start) * 1e3,
            (chain_read - manifest_read) * 1e3,
            (ended_checked - chain_read) * 1e3,
            (done - ended_checked) * 1e3,
            len(parts) - 1,
        )
        return ResumePlan(
            key,
            generated=tokens[meta.prompt_tokens :],
            pending=meta.pending,
            layout=layout,
            parts=parts,
            chain_first=meta.chain_first or 0,
            chain_next=meta.chain_next or 0,
            chain_parts=settled,
            run_start=run_start,
            base=base,
            attachments=kept,
            fetch_s=time.perf_counter() - start,
            holds=holds,
        )

    def _refuse_if_ended(self, key: bytes, namespace: str) -> None:
        """Refuses a generation that ended while its checkpoint was being read (a tombstone
        under its key now, or nothing)."""
        assert self.store is not None
        try:
            now = self.store.get_header(key, namespace)
        except TandemError:
            now = None
        if now is None:
            raise NotFound(
                "no checkpoint for this request: the generation ended (finished or "
                "cancelled) and its checkpoint was deleted"
            )
        refuse_ended(now)

    def _manifest(self, key: bytes, namespace: str) -> tuple[Checkpoint, list[HeaderRead]]:
        """The record under the generation key, and the headers of the first MAX_CHAIN
        segment keys, read in the same call (GetHeaders, the key first: the segments a
        manifest names were written before it). A chain's manifest holds no payload, so its
        header is the whole record; a whole snapshot's payload is then read with a Get. The
        headers serve a chain that starts at segment 0 (_chain)."""
        store = self.store
        assert store is not None
        keys = [key, *(segment_key(key, i) for i in range(MAX_CHAIN))]
        try:
            found, *candidates = store.get_headers(keys, namespace)
            if found.checkpoint is not None and not found.checkpoint.payload_bytes:
                return found.checkpoint, candidates
            if found.damaged:
                raise Corrupt("the checkpoint is damaged in the store (quarantined)")
            return store.get(key, namespace), candidates
        except StoreNotFound as exc:
            raise NotFound(
                "no checkpoint for this request (same request_id, prompt, sampling "
                "options and kv options are needed to resume)"
            ) from exc
        except TandemError as exc:
            raise _store_failure(exc) from exc

    def _chain(
        self,
        key: bytes,
        namespace: str,
        first: int,
        listed: int,
        listed_tokens: list[int],
        candidates: list[HeaderRead] | None = None,
        settled: tuple[int, ...] = (),
        base: ChainBase | None = None,
    ) -> list[HeldSegment]:
        """The segments of a chain: the settled parts the manifest names (each required; the
        whole snapshot first, each after it holding the positions after the one before),
        the run's segments it lists ([first, listed), each required), then those written
        after it, as far as they run on without a gap, each continuing the tokens before it
        (listed_tokens: the manifest's); a run holds at most MAX_CHAIN. candidates: the
        headers of segments first..first + MAX_CHAIN - 1, read already (_manifest). A chain
        resting on a base (a prompt's prefix record, required) has it first, and its parts
        start where the base's positions end.

        Two rounds: every candidate's header in one call (GetHeaders, no payloads), then the
        payloads of the segments that continue the chain in one call too (GetRecords), each
        into a region span of its own size, where they stay (each part's hold) until
        materialize() lands them. Reading payloads blindly cost a resume the misses' round
        trips and, with spans of an unknown size, region spans too large for several to be
        lent at once: those reads streamed over gRPC instead (a 0.6B model's resume after
        1,000 tokens on an H200: 218 ms, against 100 ms before chains); a Get a segment cost
        each a call and a stream (five 1 MiB segments: 7-8 ms on 2 cores, 2.5 in one call)."""
        store = self.store
        assert store is not None
        if not 0 <= first < listed or listed - first > MAX_CHAIN:
            raise Corrupt(f"generation checkpoint lists segments {first}..{listed - 1}")
        listed_count = listed - first
        indices = range(first, first + MAX_CHAIN)
        based = [base.key] if base is not None else []
        try:
            reads = candidates or store.get_headers(
                [*based, *(segment_key(key, i) for i in (*settled, *indices))], namespace
            )
        except TandemError as exc:
            raise _store_failure(exc) from exc
        under = [base_of(reads[0], base, listed_tokens)] if base is not None else []
        reads = reads[len(based) :]
        ahead = [header_of(read, i, True) for read, i in zip(reads, settled, strict=False)]
        runs = zip(reads[len(settled) :], indices, strict=True)
        headers = [header_of(read, i, i < listed) for read, i in runs]
        run = continuing(gapless(headers), listed_count, listed_tokens)
        parts_ahead = gapless(ahead)  # required: none is missing
        begins = base.tokens if base is not None else 0
        if (
            (parts_ahead or base)
            and run
            and not settled_before(parts_ahead, run[0], listed_tokens, begins)
        ):
            raise Corrupt(f"segment {first} of this checkpoint does not continue its parts")
        try:
            payloads = store.get_held_many(
                [
                    *based,
                    *(segment_key(key, i) for i in (*settled, *range(first, first + len(run)))),
                ],
                namespace,
                [part.checkpoint.payload_bytes for part in (*under, *parts_ahead, *run)],
            )
        except TandemError as exc:
            raise _store_failure(exc) from exc
        of_base, payloads = payloads[: len(based)], payloads[len(based) :]
        of_parts, of_run = payloads[: len(settled)], payloads[len(settled) :]
        held_base = [held_base_of(read, [*of_parts, *of_run]) for read in of_base]
        held_parts = segments_of(of_parts, 0, len(settled), [*of_run, *of_base], settled)
        parts = segments_of(of_run, first, listed_count, also=[*of_parts, *of_base])
        chain = continuing(gapless(parts), listed_count, listed_tokens)
        for part in parts[len(chain) :]:
            if part is not None and part.hold is not None:
                part.hold.release()
        return held_base + gapless(held_parts) + chain


def _store_failure(exc: TandemError) -> EngineError:
    """What a resume answers when the store could not give it the checkpoint: its bytes are
    damaged (DATA_LOSS, never tokens), or the store cannot be reached (UNAVAILABLE)."""
    if isinstance(exc, DataLoss):
        return Corrupt(f"the checkpoint is damaged in the store: {exc}")
    return Unavailable(f"the store could not serve the checkpoint: {exc}")


def _joined_with_room(planes: list[tuple[mx.array, int]]) -> mx.array:
    """Planes' first `offset` columns in order, then a batch step of zero columns."""
    first = planes[0][0]
    room = mx.zeros((*first.shape[:2], BatchQuantizedKVCache.step, first.shape[3]), first.dtype)
    return mx.concatenate([plane[..., :offset, :] for plane, offset in planes] + [room], axis=2)
