"""Who is in the engine: request ids, the pending count, whether it still admits.

The scheduler's thread-safe front door (any thread submits and cancels; the MLX thread lets
finished requests out). One lock, shared with the loop's stats, so a refusal is counted
where it is decided. Also how long the loop gathers a burst of arrivals (gather_burst).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from engine_service.errors import AlreadyExists, Overloaded, Unavailable
from engine_service.protocol.engine_stats import EngineStats
from engine_service.protocol.requests import GenerationRequest


class Admissions:
    def __init__(
        self, max_running: int, max_queued: int, stats: EngineStats, lock: threading.Lock
    ) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self._stats = stats
        self._lock = lock
        self._ids: set[str] = set()
        self._pending = 0  # admitted, not yet finished
        self._accepting = True

    def enter(self, request: GenerationRequest) -> None:
        """Counts a request in, or raises Unavailable / AlreadyExists / Overloaded."""
        with self._lock:
            if not self._accepting:
                raise Unavailable("the engine is shutting down")
            if request.request_id in self._ids:
                raise AlreadyExists(f"request {request.shown_id!r} is already running")
            if self._pending >= self.max_running + self.max_queued:
                self._stats.rejected_total += 1
                raise Overloaded(
                    f"engine full: {self._pending} requests running or queued "
                    f"(--max-running {self.max_running}, --max-queued {self.max_queued})"
                )
            self._ids.add(request.request_id)
            self._pending += 1
            self._stats.requests_total += 1

    def knows(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._ids

    def leave(self, request_id: str) -> None:
        with self._lock:
            self._ids.discard(request_id)
            self._pending -= 1

    def stop(self) -> None:
        with self._lock:
            self._accepting = False

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending


def gather_burst(
    window_s: float,
    windows: int,
    has_room: Callable[[], bool],
    waiting: Callable[[], int],
    drain: Callable[[], bool],
    newest_arrival: Callable[[], float],
) -> bool:
    """Waits for the rest of a burst of arrivals so it is prefilled in few batches, not one
    request per decode step; False when `drain` (the inbox) says to stop meanwhile.

    At most `windows` admission windows (one, or more while arrivals keep coming to an idle
    engine), and only while the batch has room. A window runs from the newest arrival's
    reaching the engine (`newest_arrival`, time.monotonic): a request that waited its window
    out while it was planned (a store read of milliseconds) is admitted at once. Sleeping also
    hands the GIL to the threads still planning or receiving the burst: with the MLX thread
    holding it ~90% of the time they would feed it one request a step.
    """
    for _ in range(windows):
        if not window_s or not has_room():
            return True
        rest = newest_arrival() + window_s - time.monotonic()
        if rest <= 0:
            return True  # nothing arrived within a window: the burst is over
        before = waiting()
        time.sleep(rest)
        if not drain():
            return False
        if waiting() == before:
            return True  # the burst is over
    return True
