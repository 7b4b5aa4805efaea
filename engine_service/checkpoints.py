"""Checkpoints between the engine and the store: prefix reuse, generation checkpoints, resume.

- Prefix reuse: a prompt's block-hash chain is looked up in an in-memory LRU of captured
  caches (bounded in bytes), then in the store; the longest hit is restored (trimmed to the
  matched length) and only the rest is prefilled. After prefill, the prompt's cache is kept in
  the LRU and sent to the store (deduplicated: `if_absent`).
- Generation checkpoints: every `checkpoint_interval` tokens the MLX thread captures the row's
  caches and its pending token; a spill thread sends them to the store, pinned while the
  generation runs, and deletes them when it ends.
- The spill queue is bounded in bytes: a checkpoint that does not fit is dropped and counted;
  a store that is down costs counted failures and a backoff, never a stalled generation.
- `flush()` is the durability barrier: it waits for everything queued before it, then the
  store's own Flush.

Network calls happen on request handler threads (lookup, get) and the spill thread (put,
delete), never on the MLX thread.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as cache_lib
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from engine_service.attachments import CapturedAttachment, check_attachment
from engine_service.attachments import find as find_attachment
from engine_service.cache_codec import (
    CapturedCache,
    capture,
    host_view,
    restore,
    settle,
    to_host,
)
from engine_service.errors import NotFound, Precondition
from engine_service.model import LoadedModel
from engine_service.prefix_cache import BLOCK_SIZE, PrefixCache
from engine_service.sampling import SamplingOptions
from tandem_client.errors import DataLoss, TandemError
from tandem_client.errors import NotFound as StoreNotFound
from tandem_client.identity import block_hashes, generation_key, prefix_key, scope_digest
from tandem_client.store_client import Attachment, Checkpoint, StoreClient, Tensor

log = logging.getLogger(__name__)

# A generation checkpoint chain holds at most this many segments before a full snapshot
# starts a new one (engine_service/scheduler.py takes it from here).
MAX_CHAIN = 16


@dataclass
class CheckpointSettings:
    store: str = ""
    local_cache_bytes: int = 512 << 20
    spill_queue_bytes: int = 1 << 30
    lease_s: int = 600
    # Smallest prompt worth saving as a prefix checkpoint.
    min_prefix_tokens: int = BLOCK_SIZE


@dataclass
class PrefixPlan:
    """Where a prompt's longest cached prefix is: the local LRU or the store's bytes."""

    matched: int
    source: str  # "local" | "store"
    key: bytes
    meta: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, tuple[str, tuple[int, ...], Any]] = field(default_factory=dict)
    fetch_s: float = 0.0
    nbytes: int = 0
    layout: list[str] = field(default_factory=list)  # the request's cache layout


@dataclass
class ResumePlan:
    """A generation checkpoint to continue from."""

    key: bytes
    generated: list[int]  # tokens emitted before the checkpoint
    pending: int  # sampled, not yet fed
    meta: dict[str, str]
    tensors: dict[str, tuple[str, tuple[int, ...], Any]]
    nbytes: int
    fetch_s: float
    # Append-only chain: (metadata, tensors) per segment, oldest first.
    segments: list[tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...], Any]]]] = field(
        default_factory=list
    )
    layout: list[str] = field(default_factory=list)
    # Companion state stored with the checkpoint, already checked against this engine.
    attachments: list[Attachment] = field(default_factory=list)


@dataclass
class CheckpointStats:
    local_hits: int = 0
    store_hits: int = 0
    misses: int = 0
    restore_failures: int = 0
    restored_bytes: int = 0
    restore_seconds: float = 0.0
    prefill_seconds: float = 0.0
    saved: int = 0
    saved_bytes: int = 0
    dropped: int = 0
    failed: int = 0
    queued_bytes: int = 0
    resumes: int = 0
    store_up: bool = True


def options_digest(options: SamplingOptions) -> bytes:
    """What a resumed request must share with the original besides prompt and request id."""
    fields = {
        k: getattr(options, k)
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "repetition_context_size",
            "seed",
            "stop",
            "stop_token_ids",
            "ignore_eos",
        )
    }
    return hashlib.blake2b(
        json.dumps(fields, sort_keys=True, default=list).encode(), digest_size=16
    ).digest()


class StoreDown(TandemError):
    """Raised inside the spill loop while it backs off from an unreachable store."""


class CheckpointManager:
    def __init__(self, loaded: LoadedModel, settings: CheckpointSettings) -> None:
        self.loaded = loaded
        self.settings = settings
        # The compute dtype is part of what a cache was computed under.
        self.model_id = f"{loaded.model_id}/{loaded.dtype}"
        self.layout = list(loaded.layout)  # plain; a request's KV codec changes its KV layers
        self.stats = CheckpointStats()
        self._local = PrefixCache(settings.local_cache_bytes)
        self._store = StoreClient(settings.store, timeout=60) if settings.store else None
        self._queue: queue.Queue[tuple[str, Any, int]] = queue.Queue()
        self._lock = threading.Lock()
        # Prefix keys already sent (bounded: a miss only costs a Put the store refuses).
        self._saved_keys: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._broken: set[bytes] = set()  # generation keys whose segment chain has a hole
        self._since_flush = {"flushed": 0, "missing": 0, "failed": 0}
        if self._store is not None:
            threading.Thread(target=self._spill_loop, name="checkpoint-spill", daemon=True).start()

    @property
    def has_store(self) -> bool:
        return self._store is not None

    def scope(self, namespace: str, layout: list[str]) -> bytes:
        return scope_digest(self.model_id, layout, namespace)

    # -- prefix reuse (handler threads) ------------------------------------------------------

    def find_prefix(
        self, prompt: list[int], namespace: str, layout: list[str]
    ) -> PrefixPlan | None:
        """The longest reusable prefix of prompt[:-1] (one token must be left to prefill)."""
        usable = prompt[:-1]
        if len(usable) < BLOCK_SIZE:
            return None
        scope = self.scope(namespace, layout)
        chain = block_hashes(usable, BLOCK_SIZE, scope)
        lengths = [min((i + 1) * BLOCK_SIZE, len(usable)) for i in range(len(chain))]
        key, local_len = self._local.match(chain, lengths)
        best: PrefixPlan | None = (
            PrefixPlan(local_len, "local", key, layout=layout) if local_len else None
        )
        if self._store is not None:
            try:
                hit = self._store.lookup(
                    namespace=namespace,
                    model_id=self.model_id,
                    layout=layout,
                    block_size=BLOCK_SIZE,
                    block_hashes=chain,
                    token_count=len(usable),
                )
                if hit.found and hit.matched_tokens > local_len:
                    start = time.perf_counter()
                    ckpt = self._store.get(hit.key, namespace)
                    best = PrefixPlan(
                        hit.matched_tokens,
                        "store",
                        hit.key,
                        ckpt.metadata,
                        _tensor_map(ckpt),
                        time.perf_counter() - start,
                        sum(t.nbytes for t in ckpt.tensors),
                        layout,
                    )
            except DataLoss as exc:  # the store quarantined it; prefill instead
                log.warning("prefix checkpoint unreadable, prefilling instead: %s", exc)
                self._count("restore_failures")
            except TandemError as exc:
                log.warning("store lookup failed, prefilling instead: %s", exc)
                self._count("restore_failures")
        if best is None:
            self._count("misses")
        return best

    def materialize_prefix(self, plan: PrefixPlan) -> list[Any] | None:
        """Caches for a plan (MLX thread): restored and trimmed to the matched length."""
        start = time.perf_counter()
        try:
            if plan.source == "local":
                captured = self._local.get(plan.key)
                if captured is None:
                    return None
                tensors = {
                    n: (captured.dtypes[n], tuple(a.shape), host_view(a))
                    for n, a in captured.arrays.items()
                }
                caches = restore(captured.meta(), tensors, plan.layout)
                held = captured.tokens
            else:
                caches = restore(plan.meta, plan.tensors, plan.layout)
                held = int(plan.meta.get("tokens", plan.matched))
            if held > plan.matched:
                if not can_trim_prompt_cache(caches):
                    return None
                trim_prompt_cache(caches, held - plan.matched)
        except (Precondition, KeyError, ValueError) as exc:
            log.warning("prefix checkpoint not restorable, prefilling instead: %s", exc)
            self._count("restore_failures")
            return None
        with self._lock:
            s = self.stats
            if plan.source == "local":
                s.local_hits += 1
            else:
                s.store_hits += 1
                s.restored_bytes += plan.nbytes
            s.restore_seconds += plan.fetch_s + time.perf_counter() - start
        return caches

    def save_prefix(
        self, row_caches: list[Any], prompt: list[int], namespace: str, layout: list[str]
    ) -> None:
        """Keeps a prompt's caches (MLX thread; row_caches hold prompt + 1 token)."""
        if len(prompt) < self.settings.min_prefix_tokens or not can_trim_prompt_cache(row_caches):
            return
        scope = self.scope(namespace, layout)
        key = prefix_key(scope, prompt)
        if key in self._local or key in self._saved_keys:
            return
        trim_prompt_cache(row_caches, 1)
        captured = capture(row_caches, len(prompt))
        chain = block_hashes(prompt, BLOCK_SIZE, scope)
        self._local.add(key, captured, chain, len(prompt))
        if self._store is None:
            return
        self._saved_keys[key] = None
        if len(self._saved_keys) > 100_000:
            self._saved_keys.popitem(last=False)
        record = Checkpoint(
            key=key,
            kind="prefix",
            namespace=namespace,
            model_id=self.model_id,
            layout=layout,
            token_ids=list(prompt),
            trimmable=True,
            block_size=BLOCK_SIZE,
            block_hashes=chain,
            metadata={**captured.meta(), "tokens": str(len(prompt))},
        )
        self._enqueue("put_prefix", (record, captured), captured.nbytes)

    # -- generation checkpoints --------------------------------------------------------------

    def generation_key(
        self,
        namespace: str,
        prompt: list[int],
        options: SamplingOptions,
        request_id: str,
        layout: list[str],
    ) -> bytes:
        return generation_key(
            self.scope(namespace, layout), prompt, options_digest(options), request_id
        )

    @staticmethod
    def segmentable(layout: list[str]) -> bool:
        """Plain KV caches only grow at the end, so a checkpoint can append what is new."""
        return all(codec == "kv:plain" for codec in layout)

    def chain_broken(self, key: bytes) -> bool:
        with self._lock:
            return key in self._broken

    def capture_generation(
        self, row_caches: list[Any], tokens: int, start: int = 0
    ) -> CapturedCache:
        """Starts a generation snapshot (MLX thread) without waiting for its copies: the
        whole caches, or with start > 0 only positions [start, tokens) of plain KV caches."""
        if start:
            segment = []
            for cache in row_caches:
                part = cache_lib.KVCache()
                part.keys = cache.keys[..., start : cache.offset, :]
                part.values = cache.values[..., start : cache.offset, :]
                part.offset = cache.offset - start
                segment.append(part)
            row_caches = segment
        return capture(row_caches, tokens, wait=False)

    def save_generation(
        self,
        key: bytes,
        namespace: str,
        captured: CapturedCache,
        prompt: list[int],
        generated: list[int],
        pending: int,
        options: SamplingOptions,
        max_tokens: int,
        layout: list[str],
        segment: tuple[int, int, int] | None = None,
        attachments: list[CapturedAttachment] | None = None,
    ) -> None:
        """Queues a generation snapshot for the store (MLX thread), once its pending token
        is known.

        segment = (index, first, start): the snapshot is segment `index` of an append-only
        chain whose live part begins at segment `first`; it holds cache positions from
        `start`. It is stored as its own record, then a tensor-less manifest under the
        generation key names the chain. Otherwise the snapshot is the whole record.
        """
        settle(captured)
        extra = []
        for attachment in attachments or []:
            settle(attachment.captured)
            extra.append(attachment.to_record())
        meta = {
            **({} if segment is not None else captured.meta()),
            "prompt_tokens": str(len(prompt)),
            "generated": str(len(generated)),
            "pending": str(pending),
            "seed": str(options.seed),
            "next_step": str(len(generated) + 1),
            "max_tokens": str(max_tokens),
            "options": options_digest(options).hex(),
        }
        record = Checkpoint(
            key=key,
            kind="generation",
            namespace=namespace,
            model_id=self.model_id,
            layout=layout,
            token_ids=list(prompt) + list(generated),
            trimmable=False,
            metadata=meta,
            attachments=extra,
        )
        if segment is None:
            nbytes = captured.nbytes + sum(a.nbytes for a in attachments or [])
            self._enqueue("put_generation", (record, captured), nbytes)
            return
        # A segment carries the generation's whole state (tokens, pending token, step) and
        # the cache positions it adds; the manifest under the generation key is written only
        # when a chain starts and names its first segment. A resume reads the manifest, then
        # the chain's segments up to the first missing one: the last of them is the state.
        # One Put per checkpoint, and a dropped segment can never be built upon.
        index, first, start = segment
        part = Checkpoint(
            key=segment_key(key, index),
            kind="object",
            namespace=namespace,
            model_id=self.model_id,
            layout=layout,
            token_ids=record.token_ids,
            trimmable=False,
            metadata={**meta, **captured.meta(), "segment_of": key.hex(), "start": str(start)},
        )
        record.metadata = {
            **meta,
            "segments_first": str(first),
            "codec": captured.meta()["codec"],
            "layout": "|".join(layout),
        }
        if start == 0:
            with self._lock:
                self._broken.discard(key)
            if not self._enqueue("put_manifest", (record, None, key), 0):
                return
        if not self._enqueue("put_segment", (part, captured, key, start), captured.nbytes):
            with self._lock:
                self._broken.add(key)  # dropped: the next snapshot starts a new chain

    def forget_generation(self, key: bytes, namespace: str, segments: int = 0) -> None:
        for index in range(segments):
            self._enqueue("delete", (segment_key(key, index), namespace), 0)
        self._enqueue("delete", (key, namespace), 0)

    def load_generation(
        self,
        key: bytes,
        namespace: str,
        prompt: list[int],
        layout: list[str],
        companions: dict[str, dict[str, str]] | None = None,
    ) -> ResumePlan:
        """The checkpoint of a generation to resume (handler thread).

        companions: attachment schema -> metadata it must carry (e.g. the draft model); the
        ones present are checked here (FAILED_PRECONDITION) and kept in the plan.
        """
        if self._store is None:
            raise Precondition("resume needs an engine started with --store")
        start = time.perf_counter()
        try:
            ckpt = self._store.get(key, namespace)
        except StoreNotFound as exc:
            raise NotFound(
                "no checkpoint for this request (same request_id, prompt, sampling "
                "options and kv options are needed to resume)"
            ) from exc
        if ckpt.model_id != self.model_id:
            raise Precondition(
                f"checkpoint was made by model {ckpt.model_id!r}; this engine "
                f"serves {self.model_id!r}"
            )
        if list(ckpt.layout) != layout:
            raise Precondition(
                f"checkpoint cache layout {list(ckpt.layout)} differs from the request's {layout}"
            )
        meta = ckpt.metadata
        n_prompt = int(meta["prompt_tokens"])
        if ckpt.token_ids[:n_prompt] != list(prompt):
            raise Precondition("checkpoint prompt differs from the request's")
        tensors, nbytes = _tensor_map(ckpt), sum(t.nbytes for t in ckpt.tensors)
        generated = list(ckpt.token_ids[n_prompt:])
        segments = []
        if "segments_first" in meta:
            first = int(meta["segments_first"])
            store = self._store

            def fetch(index: int) -> Checkpoint | None:
                try:
                    return store.get(segment_key(key, index), namespace)
                except StoreNotFound:
                    return None

            # A chain holds at most MAX_CHAIN segments; probe them all at once.
            with ThreadPoolExecutor(max_workers=8) as pool:
                found = list(pool.map(fetch, range(first, first + MAX_CHAIN)))
            parts = []
            for part in found:
                if part is None:
                    break  # the chain ends at its first missing segment
                parts.append(part)
            if not parts:
                raise NotFound("the checkpoint's first segment is not in the store")
            for part in parts:
                segments.append((part.metadata, _tensor_map(part)))
                nbytes += sum(t.nbytes for t in part.tensors)
            last = parts[-1]
            meta = {
                **last.metadata,
                "segments_first": str(first),
                "segments_next": str(first + len(parts)),
            }
            generated = list(last.token_ids[n_prompt:])
        kept = []
        for schema, expect in (companions or {}).items():
            attachment = find_attachment(ckpt.attachments, schema)
            if attachment is not None:
                check_attachment(attachment, schema, len(ckpt.token_ids), expect)
                kept.append(attachment)
        self._count("resumes")
        return ResumePlan(
            key,
            generated,
            int(meta["pending"]),
            meta,
            tensors,
            nbytes,
            time.perf_counter() - start,
            segments,
            layout,
            kept,
        )

    def materialize_resume(self, plan: ResumePlan) -> list[Any]:
        if not plan.segments:
            return restore(plan.meta, plan.tensors, plan.layout)
        parts = [restore(meta, tensors, plan.layout) for meta, tensors in plan.segments]
        caches = []
        for layer in zip(*parts, strict=True):
            cache = cache_lib.KVCache()
            cache.keys = mx.concatenate([p.keys[..., : p.offset, :] for p in layer], axis=2)
            cache.values = mx.concatenate([p.values[..., : p.offset, :] for p in layer], axis=2)
            cache.offset = sum(p.offset for p in layer)
            caches.append(cache)
        return caches

    # -- the spill queue ---------------------------------------------------------------------

    def _enqueue(self, kind: str, item: Any, nbytes: int) -> bool:
        """Queues work for the spill thread; False when it did not fit (counted as dropped)."""
        if self._store is None:
            return False
        with self._lock:
            if nbytes and self.stats.queued_bytes + nbytes > self.settings.spill_queue_bytes:
                self.stats.dropped += 1
                self._since_flush["missing"] += 1
                return False
            self.stats.queued_bytes += nbytes
        self._queue.put((kind, item, nbytes))
        return True

    def _spill_loop(self) -> None:
        assert self._store is not None
        backoff, retry_at = 0.0, 0.0
        while True:
            kind, item, nbytes = self._queue.get()
            try:
                if kind == "barrier":
                    item.set()
                    continue
                if time.monotonic() < retry_at:
                    # The store was down moments ago: fail fast instead of waiting per item;
                    # newer checkpoints supersede these.
                    raise StoreDown("store unreachable; backing off")
                self._spill(kind, item)
                backoff = 0.0
                self._set_store_up(True)
            except TandemError as exc:
                if kind == "put_prefix":  # not in the store after all: let it be sent again
                    self._saved_keys.pop(item[0].key, None)
                if kind in ("put_segment", "put_manifest"):
                    with self._lock:
                        self._broken.add(item[2])  # the next snapshot starts a new chain
                if kind != "delete":
                    self._count("failed")
                    with self._lock:
                        self._since_flush["failed"] += 1
                if not isinstance(exc, StoreDown):
                    backoff = min(max(backoff * 2, 0.25), 5.0)
                    retry_at = time.monotonic() + backoff
                    log.warning("checkpoint %s failed (%s); retrying in %.2fs", kind, exc, backoff)
                self._set_store_up(False)
            finally:
                if nbytes:
                    with self._lock:
                        self.stats.queued_bytes -= nbytes

    def _spill(self, kind: str, item: Any) -> None:
        assert self._store is not None
        if kind == "delete":
            key, namespace = item
            try:
                self._store.delete(key, namespace, force=True)
            except StoreNotFound:
                pass
            return
        if kind == "put_segment":
            part, captured, key, start = item
            if start and self.chain_broken(key):
                raise StoreDown("an earlier segment of this chain did not reach the store")
            self._put_record("put_generation", part, captured)
            return
        if kind == "put_manifest":
            record, _, key = item
            self._store.put(
                record,
                pin_ttl_s=self.settings.lease_s,
                pin_holder=f"engine/{record.key.hex()[:12]}",
            )
            return
        record, captured = item
        self._put_record(kind, record, captured)

    def _put_record(self, kind: str, record: Checkpoint, captured: CapturedCache) -> None:
        assert self._store is not None
        record.tensors = [
            Tensor(name, dtype, shape, data) for name, dtype, shape, data in to_host(captured)
        ]
        try:
            if kind == "put_prefix":
                self._store.put(record, if_absent=True)
            else:
                self._store.put(
                    record,
                    pin_ttl_s=self.settings.lease_s,
                    pin_holder=f"engine/{record.key.hex()[:12]}",
                )
        except TandemError as exc:
            if exc.code.name != "ALREADY_EXISTS":
                raise
        with self._lock:
            self.stats.saved += 1
            self.stats.saved_bytes += captured.nbytes
            self._since_flush["flushed"] += 1

    def flush(self, timeout: float = 60.0) -> tuple[bool, dict[str, int]]:
        """Waits for every checkpoint queued so far, then the store's Flush."""
        if self._store is None:
            return False, {"flushed": 0, "missing": 0, "failed": 0}
        done = threading.Event()
        self._queue.put(("barrier", done, 0))
        reached = done.wait(timeout)
        try:
            synced = reached and self._store.flush()
        except TandemError:
            synced = False
        with self._lock:
            counts, self._since_flush = self._since_flush, {"flushed": 0, "missing": 0, "failed": 0}
        durable = bool(synced) and counts["missing"] == 0 and counts["failed"] == 0
        return durable, counts

    # -- helpers -----------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _set_store_up(self, up: bool) -> None:
        with self._lock:
            self.stats.store_up = up

    def add_prefill_time(self, seconds: float) -> None:
        with self._lock:
            self.stats.prefill_seconds += seconds

    def snapshot(self) -> CheckpointStats:
        with self._lock:
            return CheckpointStats(**self.stats.__dict__)


def segment_key(key: bytes, index: int) -> bytes:
    """The record key of segment `index` of a generation checkpoint's chain."""
    return hashlib.blake2b(key + index.to_bytes(4, "big"), digest_size=32).digest()


def _tensor_map(ckpt: Checkpoint) -> dict[str, tuple[str, tuple[int, ...], Any]]:
    return {t.name: (t.dtype, tuple(t.shape), t.data) for t in ckpt.all_tensors()}
