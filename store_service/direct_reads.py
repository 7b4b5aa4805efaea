"""Direct Gets: a same-host caller reads a record's chunks straight out of the store's data
file (docs/store.md, "Direct reads"), one copy (or one DMA by its GPU) instead of the store's
checked copy into a region and the caller's copy out of it.

Why it is safe:

- **The pages stay put.** A direct Get opens a read transaction and keeps it until the
  caller's ReleaseDirect or the lease's end (`ttl_s`): LMDB reuses no page a live reader can
  see, so the offsets answered hold the record's bytes for that long. A lease that lapses
  first answers held = false, and the caller drops what it read.
- **Nothing unchecked is used.** The store checks every chunk's CRC (on its threads, from
  its own mapping) while the caller reads; the caller waits for that verdict. A damaged chunk
  is DATA_LOSS and quarantines the record, as on every other route.
- **Who gets the file.** It holds every tenant's records, so only a principal of every
  namespace (or a store without auth) is handed its fd (regions.py); it is opened read-only.
- **Compaction** swaps in another file: each placement names its file (device, inode), and a
  caller holding an older one reads through the region again until it registers anew.

A held transaction holds the store's shared lock (storage.py), so map growth and compaction
wait for leases: hence short leases and a bounded table (`max_leases`).

Where a record's chunks lie is learnt once, by the map warmer right after its put
(`remember`) or by the first direct Get: LMDB never moves the pages of a value it does not
rewrite, and a record's chunks are only ever written with it, so while the record is current
(its id in `headers`) and the file the same, its places hold. A Get then answers at once
instead of walking thousands of chunks (~5 ms a GB), and the check starts that much sooner.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from store_service import tables
from store_service.errors import Aborted, Corrupt, Overloaded, Precondition
from store_service.records import StoredRecord, chunk_key
from store_service.storage import LmdbStorage, now_ms
from tandem_wire.checksum import crc32

log = logging.getLogger("tandem.store.direct")

DEFAULT_TTL_S = 5.0
DEFAULT_MAX_LEASES = 64
MAX_REMEMBERED_CHUNKS = 1 << 20  # chunk places kept (8 bytes each), least recent dropped


@dataclass(frozen=True)
class FileIdentity:
    device: int
    inode: int


@dataclass(frozen=True)
class Placement:
    """Where a record's chunks lie in the data file, under lease `lease`."""

    lease: int
    file: FileIdentity
    chunk_offsets: list[int]
    chunk_lengths: list[int]
    expires_ms: int


@dataclass(frozen=True)
class _Places:
    """Where a record's chunks lie in one data file."""

    file: FileIdentity
    offsets: list[int]


@dataclass
class _Lease:
    release: Callable[[], None]  # ends the transaction and gives back the shared lock
    expires_at: float  # time.monotonic()
    buffers: list[memoryview]  # the chunks, views of the store's own mapping
    # The store's check reads the buffers: a lease released or lapsed meanwhile ends its
    # transaction only after the check (a map growth may remap the pages once it ends).
    checking: bool = False
    ended: bool = False

    def end(self) -> None:
        """Out of the table: the transaction ends now, or when the check is done."""
        self.ended = True
        if not self.checking:
            self.buffers.clear()
            self.release()


class DirectReads:
    """The leases of direct Gets on one storage, and the data file handed to callers."""

    def __init__(
        self,
        storage: LmdbStorage,
        ttl_s: float = DEFAULT_TTL_S,
        max_leases: int = DEFAULT_MAX_LEASES,
        check_threads: int = 4,
    ) -> None:
        self.storage = storage
        self.ttl_s = ttl_s
        self.max_leases = max_leases
        self.check_threads = check_threads
        self._lock = threading.Lock()
        self._leases: dict[int, _Lease] = {}
        self._lapsed = 0
        self._base: tuple[tuple[int, int], int] | None = None  # (mapping, its address)
        self._places: OrderedDict[int, _Places] = OrderedDict()  # by record id
        self._view: tuple[tuple[int, int], memoryview] | None = None  # ((base, size), map)
        self._remembered = 0  # chunk places in _places
        self._wake = threading.Event()
        self._closed = False
        self._sweeper = threading.Thread(target=self._sweep, name="direct-leases", daemon=True)
        self._sweeper.start()

    @property
    def enabled(self) -> bool:
        return self.max_leases > 0

    def open_file(self) -> int:
        """A read-only fd of the data file, for a caller allowed to have it (closes on exec)."""
        return os.open(self.storage.data_file, os.O_RDONLY | os.O_CLOEXEC)

    def identity(self) -> FileIdentity:
        st = os.stat(self.storage.data_file)
        return FileIdentity(st.st_dev, st.st_ino)

    def place(self, record: StoredRecord) -> Placement:
        """Opens a lease on record's chunks. Raises Overloaded (the table is full: read
        through the region), Corrupt (a chunk is missing: quarantined) or Aborted."""
        with self._lock:
            if len(self._leases) >= self.max_leases:
                raise Overloaded(f"{self.max_leases} direct reads are open, the most")
        txn, release = self.storage.hold_read()
        try:
            # The map's address and the file's identity, read under the same shared lock that
            # keeps compaction and growth (which move or replace both) away.
            file = self.identity()
            known = self._known(txn, record, file)
            if known is None:
                buffers = _chunk_buffers(self.storage, txn, record)
                offsets = self.remember(record, buffers, file)
            else:
                buffers, offsets = known
        except BaseException:
            release()
            raise
        lease = secrets.randbits(63) or 1
        expires_at = time.monotonic() + self.ttl_s
        with self._lock:
            self._leases[lease] = _Lease(release, expires_at, buffers)
        self._wake.set()
        expires_ms = now_ms() + int(self.ttl_s * 1000)
        return Placement(lease, file, offsets, [len(b) for b in buffers], expires_ms)

    def remember(
        self, record: StoredRecord, buffers: list[memoryview], file: FileIdentity | None = None
    ) -> list[int]:
        """Keeps where a record's chunks lie (buffers: its chunks, views of the map inside a
        read transaction, as the map warmer walks them after a put); their file offsets."""
        if not buffers:
            return []
        base = self._map_base(_address(buffers[0]))
        places = _Places(file or self.identity(), [_address(b) - base for b in buffers])
        if not self.enabled:
            return places.offsets
        with self._lock:
            old = self._places.pop(record.record_id, None)
            self._remembered += len(places.offsets) - (len(old.offsets) if old else 0)
            self._places[record.record_id] = places
            while self._remembered > MAX_REMEMBERED_CHUNKS and len(self._places) > 1:
                _, gone = self._places.popitem(last=False)
                self._remembered -= len(gone.offsets)
        return places.offsets

    def _known(
        self, txn: Any, record: StoredRecord, file: FileIdentity
    ) -> tuple[list[memoryview], list[int]] | None:
        """The record's chunks as views of the map, and their file offsets, from their
        remembered places, when the record is still current in this transaction and its
        first chunk is where it was; None: walk them."""
        with self._lock:
            known = self._places.get(record.record_id)
        slots = record.slots
        if known is None or known.file != file or len(known.offsets) != len(slots):
            return None
        first = txn.get(chunk_key(record.record_id, 0), db=self.storage.db["chunks"])
        if first is None or not tables.is_current(txn, self.storage.db, record):
            return None
        base = self._map_base(_address(first))
        if _address(first) - base != known.offsets[0]:
            return None
        mapped = self._mapped(base)
        views = [mapped[o : o + s.length] for o, s in zip(known.offsets, slots, strict=True)]
        return views, known.offsets

    def _mapped(self, base: int) -> memoryview:
        """The whole map, read-only (valid while the shared lock keeps it from moving)."""
        size = self.storage.map_size
        if self._view is None or self._view[0] != (base, size):
            whole = memoryview((ctypes.c_char * size).from_address(base))
            self._view = ((base, size), whole.cast("B").toreadonly())
        return self._view[1]

    def _map_base(self, inside: int) -> int:
        """Where LMDB mapped the data file in this process (LMDB reports it only for fixed
        maps): read from /proc/self/maps once per mapping (growth and compaction remap)."""
        mapping = (id(self.storage.env), self.storage.map_resizes)
        if self._base is not None and self._base[0] == mapping:
            return self._base[1]
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= inside < end:
                    base = start - int(fields[2], 16)
                    self._base = (mapping, base)
                    return base
        raise Precondition("the data file's mapping was not found in /proc/self/maps")

    def check(
        self,
        placement: Placement,
        record: StoredRecord,
        quarantine: Callable[[StoredRecord, str], None],
    ) -> None:
        """Checks every chunk of a placement against its stored CRC, on several threads.
        Raises Corrupt (the record is quarantined and the lease ended) or Aborted (the lease
        lapsed before the check could read the chunks)."""
        with self._lock:
            held = self._leases.get(placement.lease)
            if held is None:
                raise Aborted("the direct read's lease lapsed before its chunks were checked")
            held.checking = True
        buffers = held.buffers
        crcs = record.chunk_crcs
        prevs = [0 if s.starts_tensor else crcs[i - 1] for i, s in enumerate(record.slots)]

        def bad(indices: range) -> str:
            for i in indices:
                if crc32(buffers[i], prevs[i]) != crcs[i]:
                    return f"chunk {record.slots[i].index} failed its checksum"
            return ""

        workers = max(1, min(self.check_threads, len(buffers)))
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="direct-check") as pool:
                every = range(len(buffers))
                split = [every[w::workers] for w in range(workers)]
                problems = [p for p in pool.map(bad, split) if p]
        finally:
            with self._lock:
                held.checking = False
                lapsed = held.ended  # released or lapsed while checked: pages may have moved
            if lapsed:
                held.end()
        if lapsed:
            raise Aborted("the direct read's lease ended while its chunks were being checked")
        if problems:
            # Held throughout the check: the bytes are the stored ones, and they are bad.
            self.release(placement.lease)
            quarantine(record, problems[0])
            raise Corrupt(
                f"stored {problems[0]} ({record.header.key.hex()}); the record is quarantined "
                "and the bytes read directly are not to be used"
            )

    def release(self, lease: int) -> bool:
        """Ends a lease; False when it had lapsed (or never was): its pages may have moved."""
        with self._lock:
            held = self._leases.pop(lease, None)
            if held is None:
                return False
            held.end()
        return True

    def counts(self) -> tuple[int, int]:
        """(leases open, leases that lapsed since start)."""
        with self._lock:
            return len(self._leases), self._lapsed

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
            for held in leases:
                held.end()

    def _sweep(self) -> None:
        """Ends lapsed leases: a caller that died or stalled keeps no pages, and no lock."""
        while not self._closed:
            with self._lock:
                now = time.monotonic()
                lapsed = [k for k, v in self._leases.items() if v.expires_at <= now]
                ended = [self._leases.pop(k) for k in lapsed]
                self._lapsed += len(ended)
                upcoming = min((v.expires_at for v in self._leases.values()), default=None)
                for held in ended:
                    held.end()
            if ended:
                log.warning("%d direct read lease(s) lapsed unreleased", len(ended))
            self._wake.wait(None if upcoming is None else max(0.0, upcoming - time.monotonic()))
            self._wake.clear()


def _chunk_buffers(storage: LmdbStorage, txn: Any, record: StoredRecord) -> list[memoryview]:
    """The record's chunks in order, walked with one cursor (a third of the time of one
    lookup each: chunk keys sort by record, then index)."""
    cursor = txn.cursor(db=storage.db["chunks"])
    buffers = []
    found = bool(record.slots) and cursor.set_key(chunk_key(record.record_id, 0))
    for slot in record.slots:
        key = chunk_key(record.record_id, slot.index)
        if not found or cursor.key() != key:
            if tables.is_current(txn, storage.db, record):
                raise Corrupt(f"stored chunk {slot.index} of {record.header.key.hex()} is missing")
            raise Aborted("the record was replaced or removed while it was being read")
        buf = cursor.value()
        if len(buf) != slot.length:
            raise Corrupt(f"stored chunk {slot.index} of {record.header.key.hex()} is truncated")
        buffers.append(memoryview(buf))
        found = cursor.next()
    return buffers


def _address(view: memoryview) -> int:
    """Where a buffer of LMDB's mapping starts (numpy reads a buffer's address without a copy)."""
    if not view.nbytes:
        raise Precondition("an empty chunk has no place in the file")
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])
