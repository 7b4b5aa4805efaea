"""Preemption of rows whose clients stopped reading (docs/engine.md, "Slow readers").

A stream's handler counts the tokens it could not hand to gRPC because the client's HTTP/2
window is full (response_stream.RequestStream). Past `after_tokens` it asks the loop to park
the row: the loop captures the row's caches exactly as for a generation checkpoint, waits one
step for the pending token (sampled, not yet fed), then takes the row out of the batch and
keeps the capture here, within `budget_bytes`. Its slot goes to a waiting request. When the
client reads again the row goes back to the waiting queue and restarts from the capture: the
pending token is fed over the restored caches and its sampler goes on at the same step, so
its tokens are those of an uninterrupted run. A row parked longer than `idle_timeout_s` is
cancelled (its generation checkpoint, if any, is kept for a resume).

The scheduler turns commands into ask/release and calls step() after each batch step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_lm.generate import BatchGenerator

from engine_service.cache_codec import CapturedCache, capture, restore_captured
from engine_service.jobs import Job, PendingSnapshot, StartingPoint


@dataclass(frozen=True)
class ParkSettings:
    # Unread tokens (beyond what the client's HTTP/2 window took) before a row leaves its
    # slot; 0 = never.
    after_tokens: int = 256
    # Captures of parked rows held at once; a row that would pass it keeps its slot.
    budget_bytes: int = 1 << 30
    # A row parked this long is cancelled.
    idle_timeout_s: float = 300.0


@dataclass
class ParkCounters:
    preempted_total: int = 0
    unparked_total: int = 0
    idle_cancelled_total: int = 0
    over_budget_total: int = 0  # asked to park, kept running: the budget was full
    parked: int = 0
    parked_bytes: int = 0


@dataclass
class _Parked:
    snapshot: PendingSnapshot
    since: float


@dataclass
class Preemption:
    settings: ParkSettings
    counters: ParkCounters = field(default_factory=ParkCounters)
    # Asked to park, still in the batch: None until captured, then waiting for the pending
    # token.
    _leaving: dict[str, PendingSnapshot | None] = field(default_factory=dict)
    _parked: dict[str, _Parked] = field(default_factory=dict)
    # Unparked, waiting for a slot: the capture they restart from.
    _returning: dict[str, PendingSnapshot] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.settings.after_tokens > 0

    @property
    def busy(self) -> bool:
        return bool(self._leaving)

    def ask(self, job: Job) -> None:
        """The client stopped reading: the row is to leave its slot (if it has one)."""
        rid = job.request.request_id
        if job.uid >= 0 and rid not in self._leaving:
            self._leaving[rid] = None

    def release(self, job: Job) -> bool:
        """The client reads again. True when the job was parked and goes back to waiting."""
        rid = job.request.request_id
        self._leaving.pop(rid, None)
        parked = self._parked.pop(rid, None)
        if parked is None:
            return False
        self._returning[rid] = parked.snapshot
        self.counters.unparked_total += 1
        self._count()
        return True

    def step(self, bg: BatchGenerator, rows: dict[int, Job], now: float) -> None:
        """Rows asked to leave: captured on this step, out of the batch on the next one,
        when their pending token is known (the same timing as a generation snapshot)."""
        leaving = self.ready(rows)
        if leaving:
            bg.remove([job.uid for job in leaving])
            for job in leaving:
                rows.pop(job.uid)
                job.uid = -1
                self.park(job, now)
        wanted = self.to_capture(rows)
        if wanted:
            extracted = bg.extract_cache([job.uid for job in wanted])
            for job in wanted:
                found = extracted.get(job.uid)
                if found is not None:
                    held = len(job.request.prompt) + len(job.tokens)
                    self.captured(job, capture(found[0], held, wait=False))

    def to_capture(self, rows: dict[int, Job]) -> list[Job]:
        """Rows asked to leave whose caches are not captured yet."""
        by_id = {job.request.request_id: job for job in rows.values()}
        return [by_id[rid] for rid, snap in self._leaving.items() if snap is None and rid in by_id]

    def captured(self, job: Job, captured: CapturedCache) -> None:
        rid = job.request.request_id
        if self._held_bytes() + captured.nbytes > self.settings.budget_bytes:
            del self._leaving[rid]
            self.counters.over_budget_total += 1
            return
        self._leaving[rid] = PendingSnapshot(captured, list(job.tokens), None)

    def ready(self, rows: dict[int, Job]) -> list[Job]:
        """Rows whose capture's pending token is out: they leave the batch now."""
        ready = []
        for job in rows.values():
            rid = job.request.request_id
            snap = self._leaving.get(rid)
            if snap is None or len(job.tokens) == len(snap.generated):
                continue
            if len(job.tokens) == len(snap.generated) + 1:
                ready.append(job)
            else:  # more than one step since the capture: its pending token is lost
                self._leaving[rid] = None
        return ready

    def park(self, job: Job, now: float) -> None:
        """The row left the batch; its capture waits here."""
        snap = self._leaving.pop(job.request.request_id)
        assert snap is not None, "park() follows ready()"
        self._parked[job.request.request_id] = _Parked(snap, now)
        self.counters.preempted_total += 1
        self._count()

    def restart_from(self, job: Job) -> PendingSnapshot | None:
        """The capture an unparked job restarts from (taken once)."""
        parked = self._returning.pop(job.request.request_id, None)
        self._count()
        return parked

    def is_parked(self, job: Job) -> bool:
        return job.request.request_id in self._parked

    def forget(self, job: Job) -> None:
        """The job ended (finished, cancelled, failed): its capture goes."""
        rid = job.request.request_id
        self._leaving.pop(rid, None)
        held = self._returning.pop(rid, None), self._parked.pop(rid, None)
        if held != (None, None):
            self._count()

    def idle(self, now: float) -> list[str]:
        """Request ids parked longer than the idle timeout."""
        limit = self.settings.idle_timeout_s
        return [rid for rid, p in self._parked.items() if now - p.since > limit]

    def _held_bytes(self) -> int:
        held = [p.snapshot for p in self._parked.values()] + list(self._returning.values())
        return sum(s.captured.nbytes for s in held)

    def _count(self) -> None:
        self.counters.parked = len(self._parked)
        self.counters.parked_bytes = self._held_bytes()


def restart_point(job: Job, parked: PendingSnapshot) -> StartingPoint:
    """Where a parked row starts again (MLX thread): its pending token, fed over the caches
    captured before it; the sampler goes on at step len(job.tokens)."""
    r = job.request
    caches = restore_captured(parked.captured, r.layout)
    return StartingPoint([job.tokens[-1]], [*r.prompt, *parked.generated], caches, len(r.prompt))
