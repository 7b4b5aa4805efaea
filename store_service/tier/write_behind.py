"""The queue of records waiting to be copied to the tier: bounded in bytes, one entry per
record (a record queued again while waiting keeps its place), drops counted, one thread."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

log = logging.getLogger(__name__)


class WriteBehind:
    """Calls copy(ikey) for each queued record, in order, on a thread of its own."""

    def __init__(self, copy: Callable[[bytes], None], limit_bytes: int) -> None:
        self._copy = copy
        self.limit_bytes = limit_bytes
        self._queued: OrderedDict[bytes, int] = OrderedDict()  # ikey -> payload bytes
        self.queued_bytes = 0
        self.dropped = 0
        self.busy = False
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tier-write-behind", daemon=True)
        self._thread.start()

    def offer(self, ikey: bytes, payload_bytes: int) -> bool:
        """Queues a record; False (counted in `dropped`) when it would pass the limit."""
        with self._cond:
            if ikey in self._queued:
                return True
            if self.queued_bytes + payload_bytes > self.limit_bytes and self._queued:
                self.dropped += 1
                return False
            self._queued[ikey] = payload_bytes
            self.queued_bytes += payload_bytes
            self._cond.notify()
            return True

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._queued)

    def wait_idle(self, timeout: float) -> bool:
        """Until nothing is queued or being copied (Flush); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued and not self.busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued or self._closed)
                if self._closed:
                    return
                ikey, size = self._queued.popitem(last=False)
                self.busy = True
            try:
                self._copy(ikey)
            except Exception:  # one record's failure is counted by copy; the queue goes on
                log.exception("copying a record to the tier failed")
            finally:
                with self._cond:
                    self.queued_bytes -= size
                    self.busy = False
                    self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(10)
