"""Maps a freshly stored record's pages into the store's LMDB map before anyone asks for it.

LMDB writes with pwrite(2), so a record just put sits in the page cache but not in the store's
own mapping: the first Get into a region then takes a page fault every 64 KiB (the kernel's
fault-around) inside its copy threads, which measured 13.5 GB/s against 18.4 warm on the
H200's host (bench/region_copy_ceiling.py). A prefix checkpoint is put so that a later prompt
restores it, usually soon and through a region: this thread touches one byte per page of such
records after their commit, off every caller's path. It only runs while a region is
registered (a streamed Get is far slower than the faults) and skips records when behind.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from store_service.errors import StorageError
from store_service.records import StoredRecord, chunk_key
from store_service.storage import LmdbStorage

log = logging.getLogger(__name__)

PAGE = 4096
BACKLOG = 16  # records waiting; more are not warmed (a Get still works, a bit slower)


class MapWarmer:
    def __init__(
        self,
        storage: LmdbStorage,
        walked: Callable[[StoredRecord, list[memoryview]], object] | None = None,
    ) -> None:
        self._storage = storage
        # Told each warmed record's chunks (inside the read transaction): direct reads
        # remember where they lie (direct_reads.py).
        self._walked = walked
        self._queue: queue.Queue[StoredRecord | None] = queue.Queue(BACKLOG)
        self._thread = threading.Thread(target=self._run, name="map-warmer", daemon=True)
        self._thread.start()

    def warm(self, record: StoredRecord) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            pass

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    def _run(self) -> None:
        while (record := self._queue.get()) is not None:
            try:
                touch = functools.partial(
                    _touch, storage=self._storage, record=record, walked=self._walked
                )
                self._storage.read(touch, buffers=True)
            except StorageError as exc:  # closing, or a damaged file the Get will report
                log.debug("warming record %d skipped: %s", record.record_id, exc)


def _touch(
    txn: Any,
    storage: LmdbStorage,
    record: StoredRecord,
    walked: Callable[[StoredRecord, list[memoryview]], object] | None,
) -> None:
    chunks = storage.db["chunks"]
    buffers = []
    for slot in record.slots:
        buf = txn.get(chunk_key(record.record_id, slot.index), db=chunks)
        if buf is None or len(buf) != slot.length:
            return  # replaced or removed meanwhile (or damaged: the Get will say)
        # One byte per page: the fault maps it (and its neighbours); nothing is copied.
        np.frombuffer(buf, np.uint8)[::PAGE].max(initial=0)
        buffers.append(memoryview(buf))
    if walked is not None:
        walked(record, buffers)
