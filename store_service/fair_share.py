"""Limits on concurrent bulk calls (Put and PutMany, Get), so no caller holds every worker.

The store serves from a fixed pool of worker threads, and a bulk call holds one for as long
as it streams: a client that opens Puts and never sends, or Gets it never reads, holds them
all. A bulk call is admitted only while every one of these holds; otherwise it is
RESOURCE_EXHAUSTED at once, naming the flag, and holds nothing:

- its connection (one peer address: a client process's channel) has fewer than
  --max-bulk-calls-per-connection (default max_workers / 2);
- its principal (with --auth-file; without, every caller is the same nobody, so the
  connection is the finest unit) has fewer than --max-bulk-calls-per-principal (default: as
  many as one kind may hold): other tenants always find workers;
- calls of its kind (Puts, Gets) hold fewer than the bulk pool less a third of it (16 of 24
  by default): Puts that never send cannot keep Gets out, nor unread Gets Puts;
- all bulk calls together hold fewer than --max-bulk-calls (default max_workers less
  max(4, max_workers / 4)): the rest of the workers stay for small calls (Lookup, Pin,
  RegisterRegion, Stats, health).

(grpcio has no per-connection stream quota of its own beyond HTTP/2's max_concurrent_streams,
which would queue calls while they hold nothing, and cannot tell bulk calls from small ones.)
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import grpc

from store_service.errors import Overloaded
from tandem_wire.auth import current

Kind = Literal["Put", "Get"]
PUT: Kind = "Put"
GET: Kind = "Get"


@dataclass(frozen=True)
class BulkLimits:
    per_connection: int
    per_principal: int
    per_kind: int
    total: int

    @classmethod
    def for_workers(
        cls, max_workers: int, per_connection: int = 0, total: int = 0, per_principal: int = 0
    ) -> BulkLimits:
        """The defaults (0) from the worker pool; see the module's docstring."""
        total = total or max(1, max_workers - max(4, max_workers // 4))
        share = max(1, total - max(1, total // 3))
        return cls(per_connection or max(1, max_workers // 2), per_principal or share, share, total)


class BulkCallLimit:
    def __init__(self, limits: BulkLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()  # "peer:..", "principal:..", "kind:..", "all"

    def enter(self, context: grpc.ServicerContext, kind: Kind) -> None:
        """Counts a bulk call until it ends (however it ends).

        Raises: Overloaded when a limit is reached, naming it.
        """
        principal = current()
        keys = [f"peer:{context.peer()}", f"kind:{kind}", "all"]
        if principal is not None:
            keys.append(f"principal:{principal.name}")
        with self._lock:
            for key in keys:
                if self._open[key] >= self._limit(key):
                    raise Overloaded(self._refusal(key, kind))
            for key in keys:
                self._open[key] += 1

        def leave() -> None:
            with self._lock:
                for key in keys:
                    self._open[key] -= 1
                    if self._open[key] <= 0:
                        del self._open[key]

        if not context.add_callback(leave):  # the call has ended already
            leave()

    def open_calls(self) -> int:
        with self._lock:
            return self._open["all"]

    def _limit(self, key: str) -> int:
        kind = key.split(":", 1)[0]
        return {
            "peer": self.limits.per_connection,
            "principal": self.limits.per_principal,
            "kind": self.limits.per_kind,
            "all": self.limits.total,
        }[kind]

    def _refusal(self, key: str, kind: Kind) -> str:
        n, retry = self._limit(key), "; retry when one ends"
        what = key.split(":", 1)[0]
        if what == "peer":
            return (
                f"this connection has {n} Put/Get calls in progress, the most one connection "
                f"may have (--max-bulk-calls-per-connection){retry}"
            )
        if what == "principal":
            return (
                f"this principal has {n} Put/Get calls in progress, the most one principal "
                f"may have (--max-bulk-calls-per-principal){retry}"
            )
        if what == "kind":
            return (
                f"{n} {kind} calls are in progress, the most one kind may hold: the store's "
                f"bulk calls (--max-bulk-calls) less a third, kept for the other kind{retry}"
            )
        return (
            f"the store has {n} Put/Get calls in progress, its most (--max-bulk-calls): the "
            f"other workers are kept for small calls{retry}"
        )
