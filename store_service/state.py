"""What the store's rooms share: the storage, the in-memory index, counters and one mutex.

capacity.py (budget, eviction, maintenance) and recovery.py work on a StoreState without
knowing the rest; store.py's CheckpointStore assembles them around one, and admin.py
works on a CheckpointStore.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from store_service.config import StoreConfig, SyncMode
from store_service.index import RecordIndex
from store_service.storage import LmdbStorage


@dataclass
class Counters:
    """Per process lifetime (not persisted)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    puts: int = 0
    gets: int = 0
    orphans_collected: int = 0
    damaged: int = 0  # header values found damaged and set aside
    bad_index_entries: int = 0  # prefix-index entries a lookup found disagreeing with a header


class StoreState:
    """One data directory's storage and index; `mutex` guards the index and the counters."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        map_size = config.map_size_bytes or config.capacity_bytes * 5 // 4 + (64 << 20)
        self.storage = LmdbStorage(config.data_dir, map_size)
        self.index = RecordIndex()
        self.counters = Counters()
        self.mutex = threading.RLock()
        self.next_record_id = 1  # recovery moves it past every id on disk

    @property
    def sync_on_commit(self) -> bool:
        """Whether acknowledged writes wait for an fsync (sync mode `commit`)."""
        return self.config.sync_mode == SyncMode.COMMIT

    def allocate_record_id(self) -> int:
        with self.mutex:
            record_id = self.next_record_id
            self.next_record_id += 1
            return record_id
