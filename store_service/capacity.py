"""The byte budget: reservations for puts in flight, LRU eviction to make room, and the
maintenance tick that keeps recency and leases (what eviction reads) current on disk."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from store_service import tables
from store_service.config import SyncMode
from store_service.errors import Overloaded
from store_service.records import RecordInfo
from store_service.state import StoreState
from store_service.storage import now_ms

log = logging.getLogger(__name__)

MAINTENANCE_PERIOD_S = 1.0


class Capacity:
    """Keeps live payload plus reserved bytes within `--capacity-bytes`."""

    def __init__(self, state: StoreState) -> None:
        self.state = state
        self.pending: dict[int, int] = {}  # record id -> bytes, for puts in flight

    @property
    def pending_bytes(self) -> int:
        return sum(self.pending.values())

    def check_budget(self, nbytes: int) -> None:
        """Raises Overloaded if nbytes could never fit, however much were evicted."""
        capacity = self.state.config.capacity_bytes
        if nbytes > capacity:
            raise Overloaded(
                f"checkpoint of {nbytes} bytes exceeds the store's capacity of {capacity} bytes"
            )

    def reserve(self, ikey: bytes, nbytes: int, freeable: int) -> int:
        """Makes room for a put of nbytes under a fresh record id, and returns the id.

        Args:
            ikey: the record the put writes (never evicted for it).
            nbytes: its payload size.
            freeable: what replacing the record at ikey frees.

        Raises:
            Overloaded: the rest of the store is pinned or being written.
        """
        with self.state.mutex:
            self.make_room(nbytes - freeable, exclude=ikey)
            record_id = self.state.allocate_record_id()
            self.pending[record_id] = nbytes
            return record_id

    def release(self, record_id: int) -> None:
        """Forgets a reservation (the put committed or failed); repeating it is harmless."""
        with self.state.mutex:
            self.pending.pop(record_id, None)

    def eviction_victims(self, nbytes: int, exclude: bytes) -> list[RecordInfo]:
        """The least recently used unpinned records whose eviction lets nbytes more fit."""
        st = self.state
        excess = st.index.used_bytes + self.pending_bytes + nbytes - st.config.capacity_bytes
        victims: list[RecordInfo] = []
        if excess <= 0:
            return victims
        for info in st.index.eviction_order(now_ms(), exclude=[exclude]):
            if excess <= 0:
                break
            victims.append(info)
            excess -= info.payload_bytes
        if excess > 0:
            raise Overloaded(
                f"no room for {nbytes} bytes: the rest of the store is pinned or being written"
            )
        return victims

    def make_room(self, nbytes: int, exclude: bytes) -> None:
        """Evicts records until nbytes more fit (mutex held)."""
        st = self.state
        victims = self.eviction_victims(nbytes, exclude)
        if not victims:
            return
        for info in victims:
            st.index.remove(info.ikey)
            st.counters.evictions += 1
            st.counters.evicted_bytes += info.payload_bytes
            log.info(
                "evicting %s/%s (%d bytes)", info.namespace, info.key.hex(), info.payload_bytes
            )
        db = st.storage.db

        def evict(txn: Any) -> None:
            for info in victims:
                tables.delete_record(txn, db, info.ikey)

        st.storage.submit(evict)


def _libc_trim() -> Callable[[], None]:
    """glibc keeps freed heap in its arenas (a burst of large Puts left ~450 MiB resident
    after it ended); malloc_trim hands it back. Elsewhere a no-op."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0) and None


release_free_heap = _libc_trim()


class Maintenance:
    """A thread that, every second, persists access times and drops expired leases, and
    in sync mode `periodic` syncs every `--sync-interval`."""

    def __init__(self, state: StoreState, idle: Callable[[], bool] = lambda: True) -> None:
        self.state = state
        self._idle = idle  # no Put in flight: a good moment to give freed heap back
        self._stop = threading.Event()
        self._last_sync = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="store-maintenance", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def persist_access(self) -> None:
        """Writes batched access times and removes expired leases (queued, not awaited)."""
        st = self.state
        with st.mutex:
            dirty = st.index.take_dirty_access()
            expired = st.index.expired_leases(now_ms())
            for lease in expired:
                st.index.remove_lease(lease.ikey, lease.lease_id)
        if not dirty and not expired:
            return
        db = st.storage.db

        def write(txn: Any) -> None:
            tables.write_access(txn, db, dirty)
            tables.delete_leases(txn, db, [lease.lease_id for lease in expired])

        st.storage.submit(write)

    def tick(self) -> None:
        self.persist_access()
        if self._idle():
            release_free_heap()
        config = self.state.config
        if config.sync_mode == SyncMode.PERIODIC and (
            time.monotonic() - self._last_sync >= config.sync_interval_s
        ):
            self.state.storage.sync()
            self._last_sync = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(MAINTENANCE_PERIOD_S):
            try:
                self.tick()
            except Exception:  # keep maintaining; the next round retries
                log.exception("store maintenance failed")

    def stop(self) -> None:
        """Stops the thread, then persists what it would have."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.persist_access()
