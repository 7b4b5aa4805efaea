"""The half of the engine loop that other threads call (loop/scheduler.py is the other).

The core's command thread and its planning pool submit, cancel, park and read stats here;
each call only checks admission, queues a command for the engine thread or reads the stats
under the lock. Nothing here touches MLX: the engine thread (`Scheduler._run`) owns every
MLX call and applies the commands between decode steps.
"""

from __future__ import annotations

import queue
import threading
import time

from engine_service.core.capability_probe import ProbeFailed
from engine_service.core.plans import Plan
from engine_service.loop.admissions import Admissions
from engine_service.loop.commands import Cancel, Command, Park, Stop, Submit, Unpark
from engine_service.loop.jobs import Job
from engine_service.loop.limits import Limits
from engine_service.loop.step_checkpoints import StepCheckpoints
from engine_service.loop.warmup import WarmUpFailed
from engine_service.protocol.engine_stats import EngineStats
from engine_service.protocol.events import Sink
from engine_service.protocol.requests import GenerationRequest


class SchedulerInbox:
    """Admission, the command queue, the stats and the engine thread's start and stop."""

    def __init__(self, limits: Limits, step_checkpoints: StepCheckpoints | None) -> None:
        self.limits = limits
        self._step_checkpoints = step_checkpoints
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards admission counters and stats
        self._stats = EngineStats()
        self._admissions = Admissions(
            limits.max_running, limits.max_queued, self._stats, self._lock
        )
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._warm = False
        self._ready = threading.Event()
        self._start_failure: ProbeFailed | WarmUpFailed | None = None

    def _run(self) -> None:
        """The engine thread (Scheduler): sets `_ready` once it serves or failed to start."""
        raise NotImplementedError

    def start(self, warm: bool = False) -> None:
        """Starts the loop: probes what the model can do (core/capability_probe.py) and, with warm,
        runs its batch shapes once (loop/warmup.py), returning when that is done. Raises
        ProbeFailed or WarmUpFailed when the model cannot serve."""
        self._warm = warm
        self._thread.start()
        self._ready.wait()
        if self._start_failure is not None:
            raise self._start_failure

    def submit(
        self, request: GenerationRequest, sink: Sink, plan: Plan = None, arrived_at: float = 0.0
    ) -> None:
        """Admits a request or raises Overloaded / AlreadyExists / Unavailable. arrived_at:
        when it reached the engine (time.monotonic), before it was planned; 0: now."""
        self._admissions.enter(request)
        arrived_at = arrived_at or time.monotonic()
        self._inbox.put(Submit(Job(request, sink, plan, arrived_at=arrived_at)))

    def cancel(self, request_id: str, keep_checkpoint: bool = False, stopped: bool = False) -> bool:
        """Asks the loop to stop a request; False if it is not known (already finished).

        keep_checkpoint: leave its generation checkpoint in the store, for a client that went
        away and may resume; otherwise it is deleted. stopped: a stop string ended it.
        """
        known = self._admissions.knows(request_id)
        if known:
            self._inbox.put(Cancel(request_id, keep_checkpoint, stopped))
        return known

    def park(self, request_id: str) -> None:
        """Its client stopped reading: the row is to give its slot up (loop/preemption.py)."""
        self._inbox.put(Park(request_id))

    def unpark(self, request_id: str) -> None:
        """Its client reads again: a parked row goes back to the waiting queue."""
        self._inbox.put(Unpark(request_id))

    def running(self) -> bool:
        """Whether the engine thread is alive: False once it stopped, or died of an error
        its loop did not catch (the core then exits: core/process.py)."""
        return self._thread.is_alive()

    def stop_accepting(self) -> None:
        self._admissions.stop()

    def pending(self) -> int:
        return self._admissions.pending

    def shutdown(self) -> None:
        """Cancels whatever is left and stops the loop."""
        self.stop_accepting()
        self._inbox.put(Stop())
        self._thread.join(30)

    def queued_saves(self, timeout: float = 60.0) -> bool:
        """Waits until the prefixes of every delivered first token are queued for the store."""
        saves = self._step_checkpoints
        return saves is None or saves.queued_saves(timeout)

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats.snapshot(time.monotonic())
