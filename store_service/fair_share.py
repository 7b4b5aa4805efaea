"""A per-connection limit of concurrent bulk calls (Put, Get).

The store serves from a fixed pool of worker threads, and a bulk call holds one for as long
as it streams: a client that opens many Gets and stops reading them would hold them all. A
connection (one peer address: a client process's channel to the store) may have at most
`limit` bulk calls at once; one more is RESOURCE_EXHAUSTED at once, naming the limit, so
other connections always find workers. (grpcio has no per-connection stream quota of its own
beyond HTTP/2's max_concurrent_streams, which would queue calls while they hold nothing, and
cannot tell bulk calls from small ones.)
"""

from __future__ import annotations

import threading
from collections import Counter

import grpc

from store_service.errors import Overloaded


class BulkCallLimit:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()

    def enter(self, context: grpc.ServicerContext) -> None:
        """Counts a bulk call against its connection until the call ends (however it ends).

        Raises: Overloaded when the connection has `limit` bulk calls open already.
        """
        peer = context.peer()
        with self._lock:
            if self._open[peer] >= self.limit:
                raise Overloaded(
                    f"this connection has {self.limit} Put/Get calls in progress, the most "
                    "one connection may have (--max-bulk-calls-per-connection); retry when "
                    "one ends"
                )
            self._open[peer] += 1

        def leave() -> None:
            with self._lock:
                self._open[peer] -= 1
                if self._open[peer] <= 0:
                    del self._open[peer]

        if not context.add_callback(leave):  # the call has ended already
            leave()

    def open_calls(self) -> int:
        with self._lock:
            return sum(self._open.values())
