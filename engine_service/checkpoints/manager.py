"""Checkpoints between the engine and the store, wired together (docs/checkpoints.md).

- prefix_reuse.py: a prompt's longest cached prefix, local tier then store; saved after prefill.
- prefix_snapshots.py: for caches that cannot be trimmed, the prompt's state at its last block
  boundary, kept during prefill.
- generations.py: snapshots of running generations, their chains, resume.
- spill.py: the bounded queue that sends both to the store off the MLX thread.

Network calls happen on the core's planning pool (lookup, get) and the spill thread (put,
delete), never on the MLX thread.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import mlx.core as mx

from engine_service.checkpoints.device_landing import landing_for
from engine_service.checkpoints.generation_meta import ChainBase, deterministic_suffix
from engine_service.checkpoints.generations import GenerationCheckpoints
from engine_service.checkpoints.host_staging import HostStaging
from engine_service.checkpoints.prefix_cache import BLOCK_SIZE, PrefixCache
from engine_service.checkpoints.prefix_reuse import PrefixReuse
from engine_service.checkpoints.prefix_snapshots import PrefixSnapshots
from engine_service.checkpoints.spill import SpillQueue
from engine_service.core.plans import Plan, PrefixMiss, PrefixPlan, ResumePlan
from engine_service.errors import EngineError, Unavailable
from engine_service.loop.jobs import ChainPart, Job, StartingPoint
from engine_service.model.loaded import LoadedModel
from engine_service.protocol.checkpoint_stats import CheckpointCounters, CheckpointStats
from engine_service.protocol.events import PrefixMissReason
from engine_service.protocol.flush import FlushResult
from tandem_client.errors import NotFound as StoreNotFound
from tandem_client.errors import TandemError
from tandem_client.regions import SHM_DIR, SharedRegion, remove_stale_regions
from tandem_client.store_client import StoreClient
from tandem_wire.tls import is_loopback

log = logging.getLogger(__name__)
STORE_BULK_CALLS = 8


@dataclass
class CheckpointSettings:
    store: str = ""
    local_cache_bytes: int = 512 << 20
    spill_queue_bytes: int = 1 << 30
    lease_s: int = 600
    # Smallest prompt worth saving as a prefix checkpoint.
    min_prefix_tokens: int = BLOCK_SIZE
    # TLS to the store (None: plaintext) and the bearer token it wants ("" = none).
    store_credentials: grpc.ChannelCredentials | None = None
    store_token: str = ""
    # Same-host data plane: a shared-memory region the store writes restores into (0: off;
    # used only when the store's address is loopback).
    store_region_bytes: int = -1
    # Restores read out of the store's data file when it gives it (direct reads).
    direct_reads: bool = True
    # Puts queued back to back that leave in one PutMany (1: one Put a record).
    spill_batch_records: int = 32
    # Tokens a solo prefill feeds per model call (prefix snapshots: the engine's step).
    prefill_step_size: int = 2048
    # --deterministic, as its arithmetic (model/deterministic.arithmetic; "" when off):
    # checkpoints are this mode's alone (a resume keeps it), prefixes are restored at
    # prefill-chunk boundaries (prefix_reuse.PrefixReuse.align).
    deterministic: str = ""


def region_bytes(configured: int) -> int:
    """The region's size: as configured, or (-1) 256 MiB, and 8 GiB with MLX-CUDA, where a
    long prompt's cache must fit a span to be pulled by the GPU while the last prompt's
    capture may still hold another (a 32k-token prompt of a 0.6B model is 3.5 GiB: with 4
    GiB one of six H200 hits streamed); at most half of /dev/shm's free space either way."""
    if configured >= 0:
        return configured
    wanted = (8 << 30) if mx.cuda.is_available() else (256 << 20)
    free = shutil.disk_usage(SHM_DIR).free
    return max(min(wanted, free // 2) // 4096 * 4096, 0)


class CheckpointManager:
    def __init__(self, loaded: LoadedModel, settings: CheckpointSettings) -> None:
        self.settings = settings
        # The compute dtype is part of what a cache was computed under.
        self.model_id = f"{loaded.model_id}/{loaded.dtype}" + (
            deterministic_suffix(settings.deterministic)
        )
        self.counters = CheckpointCounters()
        # Below the store's per-connection bound of bulk calls (16 by default): the engine's
        # resumes, prefix reads and spill share one connection.
        self.store = (
            StoreClient(
                settings.store,
                timeout=60,
                max_bulk_calls=STORE_BULK_CALLS,
                credentials=settings.store_credentials,
                token=settings.store_token,
            )
            if settings.store
            else None
        )
        self.spill = (
            SpillQueue(
                self.store,
                settings.spill_queue_bytes,
                self.counters,
                settings.lease_s,
                settings.spill_batch_records,
            )
            if self.store is not None
            else None
        )
        self.region = self._attach_region() if self.store is not None else None
        # Captures become host bytes, and store bytes arrays, through the region when the
        # store took one: one staging for prefixes and generations.
        # A layer's keys and values: the planes of a direct hit, landed in one launch.
        landing = landing_for(self.region, 2 * len(loaded.layout))
        staging = HostStaging(landing, self.store if self.region else None)
        self.prefixes = PrefixReuse(
            self.model_id,
            PrefixCache(settings.local_cache_bytes),
            self.counters,
            self.store,
            self.spill,
            settings.min_prefix_tokens,
            staging,
            settings.prefill_step_size if settings.deterministic else 1,
        )
        self.snapshots = PrefixSnapshots(loaded.model, self.prefixes, settings.prefill_step_size)
        self.generations = GenerationCheckpoints(
            self.model_id, self.counters, self.store, self.spill, staging
        )
        self._loader = ThreadPoolExecutor(2, thread_name_prefix="checkpoint-read-back")

    def _attach_region(self) -> SharedRegion | None:
        """The same-host data plane, when the store is on this host and takes the region;
        otherwise reads stream over gRPC (logged, never fatal)."""
        size, store = self.settings.store_region_bytes, self.store
        if not size or store is None or not is_loopback(self.settings.store):
            return None
        if not SHM_DIR.is_dir():
            return None
        size = region_bytes(size)
        if not size:
            return None
        for name in remove_stale_regions():
            log.info("removed shared-memory region %s left by a process that is gone", name)
        region = None
        try:
            region = SharedRegion(size)
            store.attach_region(region, direct=self.settings.direct_reads)
        except (OSError, ValueError, TandemError) as exc:
            log.warning("store reads stream over gRPC (no shared-memory region: %s)", exc)
            if region is not None:
                region.close()
            return None
        log.info("store reads go through shared-memory region %s (%d MiB)", region.name, size >> 20)
        return region

    def close(self) -> None:
        """Gives the region back (at shutdown)."""
        self.prefixes.landing.close()
        if self.store is not None and self.region is not None:
            self.store.detach_region()
            self.region.close()
            self.region = None

    @property
    def has_store(self) -> bool:
        return self.store is not None

    def prefix_start(self, job: Job, confirm_later: bool = False) -> StartingPoint:
        """Where a fresh prompt starts (MLX thread): its cached prefix restored, or why it
        reused none; for caches that cannot be trimmed, a snapshot on the way
        (checkpoints/prefix_snapshots.py). confirm_later: a direct store hit may come back
        unconfirmed (prefix_reuse.py); the caller confirms it after the row's first step."""
        r, plan = job.request, job.plan
        caches, cached, reason = None, 0, _miss_reason(plan, len(r.prompt))
        unconfirmed = None
        if isinstance(plan, PrefixPlan):
            # A snapshot is taken from the caches at once: from confirmed bytes only.
            later = confirm_later and not self.snapshots.due(r, plan.matched)
            caches, unconfirmed = self.prefixes.materialize(plan, later)
            if caches is None:
                reason = "not restorable"
            else:
                cached = plan.matched
                # The store's copy holds these very bytes: an exact record, or a compressed
                # one restored from the store (the row holds its expansion; the local tier
                # keeps a compressed prompt's caches as computed, not as stored).
                if not r.prefix_record.tag or plan.source == "store":
                    job.restored_prefix = ChainBase(plan.key, cached)
        elif isinstance(plan, PrefixMiss):
            job.plan = None  # a whole prefill, as a prompt that was never looked up
        if reason:
            self.counters.miss(reason)
        source = plan.prefix_source if isinstance(plan, PrefixPlan) and cached else ""
        k = self.snapshots.due(r, cached)
        if k:
            caches = self.snapshots.take(r, caches, cached, k)
            return StartingPoint(r.prompt[k:], r.prompt[:k], caches, cached, reason, source)
        if caches is not None:
            return StartingPoint(
                r.prompt[cached:], r.prompt[:cached], caches, cached, "", source, unconfirmed
            )
        return StartingPoint(r.prompt, [], None, 0, reason)

    def add_prefill_time(self, seconds: float) -> None:
        self.counters.add(prefill_seconds=seconds)

    def snapshot(self) -> CheckpointStats:
        stats = self.counters.snapshot()
        if self.store is not None:
            stats.shared_memory_reads = self.store.region_reads
            stats.reads_by_route = self.store.read_routes
        cost = self.prefixes.cost.snapshot()
        stats.restore_bytes_per_second = cost.restore_bytes_per_second
        stats.prefill_tokens_per_second = cost.prefill_tokens_per_second
        stats.restore_chosen, stats.prefill_chosen = cost.restore_chosen, cost.prefill_chosen
        return stats

    def check_store(self) -> str:
        """Whether the store can be reached and accepts this engine's credentials: "" when
        it does, else one line saying why (a probe for a key nobody writes)."""
        if self.store is None:
            return ""
        try:
            self.store.get_header(b"\x00tandem-engine-probe")
        except StoreNotFound:
            return ""
        except TandemError as exc:
            return f"the store at {self.settings.store} refused or was unreachable: {exc}"
        return ""

    def read_back(self, job: Job, done: Callable[[ResumePlan | None, str], None]) -> None:
        """Reads a row parked in the store back, off the MLX thread: once what the spill
        queue holds was sent, its checkpoint is loaded; done(plan, "") or done(None, why)."""
        r = job.request

        def run() -> None:
            try:
                if self.spill is None or not self.spill.wait_sent(60):
                    raise Unavailable("its snapshot did not leave the spill queue")
                plan = self.generations.loads.load(
                    job.checkpoint_key, r.namespace, r.prompt, r.layout
                )
            except EngineError as exc:
                done(None, str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a bug: logged, the stream told
                log.exception("reading parked %s back failed", r.request_id)
                done(None, f"internal error: {exc}")
                return
            done(plan, "")

        self._loader.submit(run)

    def flush(self, timeout: float = 60.0) -> FlushResult:
        """The durability barrier: every checkpoint queued so far, then the store's Flush."""
        if self.spill is None:
            return FlushResult(durable=False)
        return self.spill.flush(timeout)


def starting_point(
    job: Job, checkpoints: CheckpointManager | None, confirm_later: bool = False
) -> StartingPoint:
    """Restores a job's checkpoint, if it has one (MLX thread), and says what to feed
    (confirm_later: CheckpointManager.prefix_start)."""
    r, plan = job.request, job.plan
    if isinstance(plan, ResumePlan) and checkpoints is not None:
        # The restored cache holds prompt + generated; the pending token is fed next and
        # the sampler goes on at the step after it.
        job.tokens = plan.replay
        job.last_checkpoint_at = len(job.tokens)
        if plan.logprob_log is not None and job.logprob_log is not None:
            job.logprob_log = plan.logprob_log  # its pages go on from the last one read
        # Go on with the chain the checkpoint belongs to.
        job.chain.next_index, job.chain.first = plan.chain_next, plan.chain_first
        job.chain.covered = len(r.prompt) + len(plan.generated)
        # Its parts and run, of unknown age: a full run starts over with a whole snapshot.
        parts = [ChainPart(i, 0, 0, 0) for i in plan.chain_parts]  # only named again
        job.chain.parts, job.chain.base_at = parts, 0.0
        job.chain.head = ChainPart(plan.chain_first, plan.run_start, job.chain.covered, 1)
        job.chain.base = plan.base
        checkpoints.generations.chains.hold_base(job)
        job.checkpointed = True
        caches = checkpoints.generations.loads.materialize(plan)
        return StartingPoint([plan.pending], [*r.prompt, *plan.generated], caches, len(r.prompt))
    if checkpoints is None:
        return StartingPoint(r.prompt, [], None, 0, "prefix reuse off")
    return checkpoints.prefix_start(job, confirm_later)


def _miss_reason(plan: Plan, prompt_tokens: int) -> PrefixMissReason:
    if isinstance(plan, PrefixMiss):
        return plan.reason
    if plan is None:  # not looked up (planner.needed)
        return "shorter than a block" if prompt_tokens <= BLOCK_SIZE else "no stored prefix"
    return ""
