"""The loop's side of parked rows: park and unpark commands, rows leaving the batch after a
step (a stalled client's, or a turn's: loop/turns.py), a row read back from the store, and parked
rows whose client stayed away too long (the policy itself: loop/preemption.py)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Protocol

from mlx_lm.generate import BatchGenerator

from engine_service.checkpoints.manager import CheckpointManager
from engine_service.errors import Corrupt
from engine_service.loop.commands import Park, Restored, Unpark
from engine_service.loop.jobs import Job, PendingSnapshot
from engine_service.loop.preemption import Left, Preemption, Return
from engine_service.protocol.events import Event, Finished


class ParkingHost(Protocol):
    """What parking needs of the loop that owns it."""

    def emit(self, job: Job, events: list[Event]) -> None: ...

    def finish(self, job: Job) -> None: ...


class Parking:
    def __init__(
        self,
        host: ParkingHost,
        preemption: Preemption,
        checkpoints: CheckpointManager | None,
        waiting: collections.deque[Job],
        by_id: dict[str, Job],
        post: Callable[[Restored], None],
    ) -> None:
        self.host = host
        self.preemption = preemption
        self.checkpoints = checkpoints
        self.waiting = waiting
        self.by_id = by_id
        self.post = post  # into the loop's inbox, from the thread that read the store

    def command(self, command: Park | Unpark) -> None:
        job = self.by_id.get(command.request_id)
        if job is None or not self.preemption.enabled:
            return
        if isinstance(command, Park):
            if self.preemption.ask(job, time.monotonic()):
                self.waiting.remove(job)  # it was queued after a turn: it waits parked now
            return
        back = self.preemption.release(job)
        if back is Return.WAIT_FOR_SLOT:
            self.waiting.append(job)
        elif back is Return.READ_FROM_STORE:
            self._read_back(job)

    def joined(self, jobs: list[Job]) -> None:
        """Rows that got a slot (their turns start)."""
        self.preemption.joined(jobs)

    def step(self, bg: BatchGenerator, rows: dict[int, Job], free: int) -> None:
        """After a batch step: rows whose turn is over while requests wait are asked to
        leave, and rows asked before leave; those out for a turn queue again at once."""
        self.preemption.take_turns(rows, len(self.waiting), free)
        if not self.preemption.busy:
            return
        for left in self.preemption.step(bg, rows, time.monotonic(), self.save):
            if left.then is Left.QUEUED:
                self.waiting.append(left.job)
            elif left.then is Left.READ_BACK:
                self._read_back(left.job)

    def _read_back(self, job: Job) -> None:
        assert self.checkpoints is not None, "only an engine with a store parks rows there"
        rid = job.request.request_id
        self.checkpoints.read_back(job, lambda plan, error: self.post(Restored(rid, plan, error)))

    def save(self, job: Job, snapshot: PendingSnapshot) -> bool:
        """Parks a row's snapshot in the store (when its bytes are over the park budget)."""
        if self.checkpoints is None:
            return False
        return self.checkpoints.generations.save_parked(job, snapshot)

    def restored(self, command: Restored) -> None:
        job = self.by_id.get(command.request_id)
        if job is None or not self.preemption.is_parked(job):
            return  # cancelled meanwhile
        plan = command.plan
        if plan is None or plan.replay != job.tokens:
            why = command.error or "the store holds an older state than the parked row"
            job.keep_checkpoint, job.ended = True, "failed"
            self.host.finish(job)
            lost = f"the parked generation is lost: {why}"
            self.host.emit(job, [Finished("error", error=lost, failure=Corrupt.__name__)])
            return
        if self.preemption.restored(job, plan, time.monotonic()):
            self.waiting.append(job)

    def idle_expired(self, now: float) -> list[str]:
        """Parked rows whose client read nothing for the idle timeout (kept: resumable)."""
        expired = self.preemption.idle(now)
        for request_id in expired:
            self.by_id[request_id].keep_checkpoint = True  # the client may come back
            self.preemption.counters.idle_cancelled_total += 1
        return expired
