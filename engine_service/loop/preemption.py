"""Preemption of rows whose clients stopped reading (docs/engine.md, "Slow readers").

A stream's handler counts the tokens it could not hand to gRPC because the client's HTTP/2
window is full (response_stream.RequestStream). Past `after_tokens` it asks the loop to park
the row: the loop captures the row's caches exactly as for a generation checkpoint, waits one
step for the pending token (sampled, not yet fed), then takes the row out of the batch. Its
slot goes to a waiting request. A checkpointed generation's park snapshot also goes to the
store (so it survives an engine crash); the capture stays in memory within `budget_bytes`,
and beyond it a checkpointed row is parked in the store only (its memory freed). When the
client reads again the row goes back to the waiting queue and restarts from the capture, or
from the store once it is read back: the pending token is fed over the restored caches and
its sampler goes on at the same step, so its tokens are those of an uninterrupted run. A row
parked longer than `idle_timeout_s` is cancelled (its checkpoint, if any, is kept).

Turns (loop/turns.py) use the same way out of the batch: a row whose turn is over while others
wait leaves as a parked row does, but is queued again at once; a checkpointed one goes to the
store only when its capture is over the memory budget. Whether a row that left waits for its
client or for a slot is decided by `_stalled` when it leaves, and a client may stall or read
again at any point on that way (running, leaving, queued, being read back).

The scheduler turns commands into ask/release/restored and calls step() after each batch
step; it makes the store calls through its checkpoints (never on the MLX thread).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import BatchGenerator

from engine_service.checkpoints.cache_records import CapturedCache, capture, restore_captured
from engine_service.core.plans import ResumePlan
from engine_service.device_memory import cache_given_back, is_out_of_memory
from engine_service.loop.jobs import Job, PendingSnapshot, StartingPoint
from engine_service.loop.turns import due_turns
from engine_service.protocol.engine_stats import ParkCounters

log = logging.getLogger(__name__)

# Queues a parked row's snapshot for the store; False when it cannot (no store, not a
# checkpointed request, or the spill queue is full).
SaveToStore = Callable[[Job, PendingSnapshot], bool]


@dataclass(frozen=True)
class ParkSettings:
    # Unread tokens (beyond what the client's HTTP/2 window took) before a row leaves its
    # slot; 0 = never.
    after_tokens: int = 256
    # Captures of parked rows held in memory at once. Beyond it a checkpointed row is parked
    # in the store only; any other keeps its slot.
    budget_bytes: int = 1 << 30
    # A row parked this long is cancelled.
    idle_timeout_s: float = 300.0
    # Tokens a row generates in its slot before it gives the slot up to a waiting request
    # (loop/turns.py); 0 = no turns.
    turn_tokens: int = 512


class Return(enum.Enum):
    """What a release asks of the scheduler."""

    NOTHING = enum.auto()  # it was not parked
    WAIT_FOR_SLOT = enum.auto()  # its capture is in memory: back to the waiting queue
    READ_FROM_STORE = enum.auto()  # parked in the store only: read it back first


class Left(enum.Enum):
    """Where a row that left the batch went."""

    PARKED = enum.auto()  # its client stopped reading: it waits for it
    QUEUED = enum.auto()  # a turn, its capture in memory: back to the waiting queue now
    READ_BACK = enum.auto()  # a turn parked in the store only: queued once read back


@dataclass(frozen=True)
class Departure:
    job: Job
    then: Left


# What a row out of the batch restarts from: its capture, or its checkpoint read back.
Restart = PendingSnapshot | ResumePlan


@dataclass
class _Leaving:
    snapshot: PendingSnapshot | None = None  # None until captured
    store_only: bool = False  # over the memory budget: park in the store, free the capture
    turn: bool = False  # leaving for a turn, not for a client that stopped reading


@dataclass
class _Parked:
    snapshot: Restart | None  # None: in the store only
    since: float
    loading: bool = False  # being read back from the store


@dataclass
class Preemption:
    settings: ParkSettings
    counters: ParkCounters = field(default_factory=ParkCounters)
    _leaving: dict[str, _Leaving] = field(default_factory=dict)  # asked, still in the batch
    _parked: dict[str, _Parked] = field(default_factory=dict)
    # Unparked (or out for a turn), waiting for a slot: what they restart from.
    _returning: dict[str, Restart] = field(default_factory=dict)
    # Clients whose window is full: asked to park, not released yet. Kept apart from where
    # the row is, since a row out for a turn may stall, or read again, anywhere on its way.
    _stalled: set[str] = field(default_factory=set)

    @property
    def enabled(self) -> bool:
        return self.settings.after_tokens > 0

    @property
    def busy(self) -> bool:
        return bool(self._leaving)

    def ask(self, job: Job, now: float) -> bool:
        """The client stopped reading: the row is to leave its slot (if it has one).

        Returns True when the job was waiting for a slot with a capture (out for a turn, or
        unparked): it is parked again where it is and the caller takes it off the queue.
        """
        rid = job.request.request_id
        self._stalled.add(rid)
        if job.uid >= 0:
            self._leaving.setdefault(rid, _Leaving())
            return False
        back = self._returning.pop(rid, None)
        if back is None:  # parked, being read back, or never ran (joined() sees to it)
            return False
        self._parked[rid] = _Parked(back, now)
        self.counters.preempted_total += 1
        self._count()
        return True

    def release(self, job: Job) -> Return:
        """The client reads again."""
        rid = job.request.request_id
        self._stalled.discard(rid)
        leaving = self._leaving.get(rid)
        if leaving is not None and not leaving.turn:  # a turn still ends: others wait
            del self._leaving[rid]
        parked = self._parked.get(rid)
        if parked is None or parked.loading:
            return Return.NOTHING
        self.counters.unparked_total += 1
        if parked.snapshot is None:
            parked.loading = True
            return Return.READ_FROM_STORE
        del self._parked[rid]
        self._returning[rid] = parked.snapshot
        self._count()
        return Return.WAIT_FOR_SLOT

    def restored(self, job: Job, plan: ResumePlan, now: float) -> bool:
        """A row parked in the store was read back. True: it waits for a slot; False: its
        client stopped reading meanwhile, it stays parked (in memory now)."""
        rid = job.request.request_id
        if rid in self._stalled:
            self._parked[rid] = _Parked(plan, now)
            self._count()
            return False
        del self._parked[rid]
        self._returning[rid] = plan
        self._count()
        return True

    def joined(self, jobs: list[Job]) -> None:
        """Rows that got a slot: their turn starts now. One whose client stalled while it
        had no capture to park (a row recomputed after a failed step) leaves again."""
        for job in jobs:
            job.turn_start = len(job.tokens)
            rid = job.request.request_id
            if rid in self._stalled:
                self._leaving.setdefault(rid, _Leaving())

    def take_turns(self, rows: dict[int, Job], waiting: int, free: int) -> None:
        """Rows whose turn is over while requests wait for a full batch are asked to leave."""
        leaving = self._leaving
        turns = self.settings.turn_tokens
        for job in due_turns(rows.values(), waiting, free, turns, leaving, len(leaving)):
            leaving[job.request.request_id] = _Leaving(turn=True)

    def step(
        self, bg: BatchGenerator, rows: dict[int, Job], now: float, save: SaveToStore
    ) -> list[Departure]:
        """Rows asked to leave: captured on this step, out of the batch on the next one,
        when their pending token is known (the same timing as a generation snapshot).
        Returns the rows that left and where they went."""
        leaving = self._ready(rows)
        left = []
        if leaving:
            bg.remove([job.uid for job in leaving])
            for job in leaving:
                rows.pop(job.uid)
                job.uid = -1
                left.append(Departure(job, self._park(job, now, save)))
        wanted = self._to_capture(rows)
        if wanted:
            captures: dict[int, CapturedCache] = {}
            try:
                extracted = bg.extract_cache([job.uid for job in wanted])
                for job in wanted:
                    found = extracted.get(job.uid)
                    if found is not None:
                        held = len(job.request.prompt) + len(job.tokens)
                        captures[job.uid] = capture(found[0], held, wait=False)
            except Exception as exc:  # a device out of memory, ...: must not end the loop
                self._not_captured(wanted, exc)
                return left
            for job in wanted:
                if job.uid in captures:
                    self._captured(job, captures[job.uid])
        return left

    def _not_captured(self, jobs: list[Job], failure: Exception) -> None:
        """Rows whose capture raised keep their slots, as over the budget: their batch is
        untouched (a capture only reads it), and a row never leaves without its state."""
        log.warning(
            "%d rows could not be captured to leave the batch (%s); they keep their slots",
            len(jobs),
            failure,
            exc_info=not is_out_of_memory(failure),
        )
        cache_given_back(failure)
        for job in jobs:
            del self._leaving[job.request.request_id]
            job.turn_start = len(job.tokens)  # not asked again before another turn
        self.counters.capture_failed_total += len(jobs)

    def _to_capture(self, rows: dict[int, Job]) -> list[Job]:
        by_id = {job.request.request_id: job for job in rows.values()}
        return [
            by_id[rid]
            for rid, leaving in self._leaving.items()
            if leaving.snapshot is None and rid in by_id
        ]

    def _captured(self, job: Job, captured: CapturedCache) -> None:
        rid = job.request.request_id
        over = self._held_bytes() + captured.nbytes > self.settings.budget_bytes
        if over and not job.checkpoint_key:  # nowhere to put it: the row keeps its slot
            del self._leaving[rid]
            job.turn_start = len(job.tokens)  # not asked again before another turn
            self.counters.over_budget_total += 1
            return
        snapshot = PendingSnapshot(captured, list(job.tokens), None)
        turn = self._leaving[rid].turn
        self._leaving[rid] = _Leaving(snapshot, store_only=over, turn=turn)

    def _ready(self, rows: dict[int, Job]) -> list[Job]:
        """Rows whose capture's pending token is out: they leave the batch now."""
        ready = []
        for job in rows.values():
            rid = job.request.request_id
            leaving = self._leaving.get(rid)
            if leaving is None or leaving.snapshot is None:
                continue
            taken = len(leaving.snapshot.generated)
            if len(job.tokens) == taken + 1:
                ready.append(job)
            elif len(job.tokens) > taken + 1:  # more than one step: its pending token is lost
                leaving.snapshot = None
        return ready

    def _park(self, job: Job, now: float, save: SaveToStore) -> Left:
        rid = job.request.request_id
        leaving = self._leaving.pop(rid)
        assert leaving.snapshot is not None, "only captured rows are ready"
        # A turn whose client stopped reading meanwhile is parked like any stalled row.
        stalled = rid in self._stalled
        # A stalled checkpointed row's snapshot also goes to the store, so an engine crash
        # while its client is away loses nothing; a turn's only when memory is over budget
        # (it comes back soon: no store traffic per turn).
        to_store = (stalled or leaving.store_only) and bool(job.checkpoint_key)
        in_store = to_store and save(job, leaving.snapshot)
        # A snapshot the store will not get stays in memory, even over the budget: the row
        # has left the batch already.
        keep = leaving.snapshot if not (leaving.store_only and in_store) else None
        if keep is None:
            self.counters.parked_to_store_total += 1
        if stalled:
            self._parked[rid] = _Parked(keep, now)
            self.counters.preempted_total += 1
            then = Left.PARKED
        elif keep is None:
            self._parked[rid] = _Parked(None, now, loading=True)
            self.counters.turns_yielded_total += 1
            then = Left.READ_BACK
        else:
            self._returning[rid] = keep
            self.counters.turns_yielded_total += 1
            then = Left.QUEUED
        self._count()
        return then

    def restart_from(self, job: Job) -> Restart | None:
        """What an unparked job restarts from (taken once)."""
        parked = self._returning.pop(job.request.request_id, None)
        self._count()
        return parked

    def is_parked(self, job: Job) -> bool:
        return job.request.request_id in self._parked

    def forget(self, job: Job) -> None:
        """The job ended (finished, cancelled, failed): its capture goes."""
        rid = job.request.request_id
        self._leaving.pop(rid, None)
        self._stalled.discard(rid)
        held = self._returning.pop(rid, None), self._parked.pop(rid, None)
        if held != (None, None):
            self._count()

    def idle(self, now: float) -> list[str]:
        """Request ids parked longer than the idle timeout."""
        limit = self.settings.idle_timeout_s
        return [rid for rid, p in self._parked.items() if not p.loading and now - p.since > limit]

    def _held_bytes(self) -> int:
        held = [p.snapshot for p in self._parked.values()] + list(self._returning.values())
        return sum(s.captured.nbytes for s in held if isinstance(s, PendingSnapshot))

    def _count(self) -> None:
        self.counters.parked = len(self._parked)
        self.counters.parked_bytes = self._held_bytes()


def restart_point(
    job: Job,
    parked: Restart,
    materialize: Callable[[ResumePlan], list[Any]] | None,
) -> StartingPoint:
    """Where a parked row starts again (MLX thread): its pending token, fed over the caches
    captured before it or read back from the store; the sampler goes on at step
    len(job.tokens)."""
    r = job.request
    if isinstance(parked, ResumePlan):
        assert materialize is not None, "only an engine with a store parks rows there"
        caches = materialize(parked)
    else:
        caches = restore_captured(parked.captured, r.layout)
    return StartingPoint([job.tokens[-1]], [*r.prompt, *job.tokens[:-1]], caches, len(r.prompt))
