"""Constraint compiling within a time budget, on threads of its own (docs/structured-output.md).

llguidance compiles a grammar in native code that lets other threads run, but a large one (a
1,999-option choice, a schema of hundreds of properties, a long Lark grammar) takes from tens
of milliseconds to seconds, and only its fuel limits bound it: they count work, not seconds,
and the same grammar costs more with a larger vocabulary. So compiles run on a small pool of
their own: a flood of heavy grammars waits there, never in the executor the front's other
requests use, and never on the core's batch loop. A caller waits at most `timeout_s`:

- a compile that ran past it is refused as too complex (INVALID_ARGUMENT), and that
  constraint is remembered, so sending it again is refused at once instead of taking a
  compile thread each time;
- a compile still waiting behind others' when the time is up is RESOURCE_EXHAUSTED: the
  caller may retry, the constraint is not to blame.

A compile that overran still finishes in its thread (native code cannot be interrupted), which
is why the pool is small: it bounds the CPU that compiles can take from decoding.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from engine_service.errors import InvalidRequest, Overloaded

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 10.0
# Constraints remembered as too complex (by digest); the oldest are forgotten first.
MAX_REMEMBERED = 1024


class CompileBudget:
    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = 2) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="constraint-compile")
        self._lock = threading.Lock()
        self._too_complex: OrderedDict[str, None] = OrderedDict()
        self.refused_too_complex = 0
        self.refused_busy = 0

    def run(self, digest: str, what: str, compile_it: Callable[[], T]) -> T:
        """compile_it() on the pool, waited for at most timeout_s (blocking: call it off the
        event loop). Raises what it raises, InvalidRequest (too complex) or Overloaded."""
        with self._lock:
            if digest in self._too_complex:
                self.refused_too_complex += 1
                raise self._too_complex_error(what)
        started: list[float] = []

        def task() -> T:
            started.append(time.monotonic())
            return compile_it()

        future = self._pool.submit(task)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            pass
        # It never started, or started too late to have had a fair share of the budget: the
        # pool was busy with other compiles.
        ran_s = time.monotonic() - started[0] if started else 0.0
        if future.cancel() or ran_s < self.timeout_s / 2:
            with self._lock:
                self.refused_busy += 1
            raise Overloaded(
                "the engine is busy compiling other constraints; retry in a moment "
                f"(--constraint-compile-timeout {self.timeout_s:g} s)"
            )
        with self._lock:
            self.refused_too_complex += 1
            self._too_complex[digest] = None
            while len(self._too_complex) > MAX_REMEMBERED:
                self._too_complex.popitem(last=False)
        raise self._too_complex_error(what)

    def _too_complex_error(self, what: str) -> InvalidRequest:
        return InvalidRequest(
            f"{what} did not compile within {self.timeout_s:g} s "
            "(--constraint-compile-timeout): too complex; simplify it"
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
