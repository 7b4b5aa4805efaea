"""The in-memory view of what the store holds: records in LRU order, and their leases.

Rebuilt from LMDB at start-up; the store's mutex guards every call. Eviction order,
capacity accounting and filters read it instead of scanning LMDB.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from store_service.records import Lease, RecordFilter, RecordInfo


class RecordIndex:
    def __init__(self) -> None:
        # Least recently used first.
        self._records: OrderedDict[bytes, RecordInfo] = OrderedDict()
        self._leases: dict[bytes, dict[str, Lease]] = {}
        self._dirty_access: dict[bytes, int] = {}
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def get(self, ikey: bytes) -> RecordInfo | None:
        return self._records.get(ikey)

    def put(self, info: RecordInfo) -> RecordInfo | None:
        """Adds or replaces a record; it becomes the most recently used."""
        old = self.remove(ikey=info.ikey, keep_leases=True)
        self._records[info.ikey] = info
        self.used_bytes += info.payload_bytes
        return old

    def remove(self, ikey: bytes, keep_leases: bool = False) -> RecordInfo | None:
        old = self._records.pop(ikey, None)
        if old is not None:
            self.used_bytes -= old.payload_bytes
        self._dirty_access.pop(ikey, None)
        if not keep_leases:
            self._leases.pop(ikey, None)
        return old

    def touch(self, ikey: bytes, now_ms: int) -> None:
        info = self._records.get(ikey)
        if info is None:
            return
        info.last_access_ms = now_ms
        self._records.move_to_end(ikey)
        self._dirty_access[ikey] = now_ms

    def take_dirty_access(self) -> dict[bytes, int]:
        dirty, self._dirty_access = self._dirty_access, {}
        return dirty

    # -- leases ------------------------------------------------------------------------------

    def add_lease(self, lease: Lease) -> None:
        self._leases.setdefault(lease.ikey, {})[lease.lease_id] = lease

    def remove_lease(self, ikey: bytes, lease_id: str) -> Lease | None:
        leases = self._leases.get(ikey, {})
        lease = leases.pop(lease_id, None)
        if not leases:
            self._leases.pop(ikey, None)
        return lease

    def leases_of(self, ikey: bytes) -> list[Lease]:
        return list(self._leases.get(ikey, {}).values())

    def is_pinned(self, ikey: bytes, now_ms: int) -> bool:
        return any(lease.expires_ms > now_ms for lease in self._leases.get(ikey, {}).values())

    def expired_leases(self, now_ms: int) -> list[Lease]:
        return [
            lease
            for leases in self._leases.values()
            for lease in leases.values()
            if lease.expires_ms <= now_ms
        ]

    def pinned_count(self, now_ms: int) -> int:
        return sum(
            1 for ikey in self._leases if ikey in self._records and self.is_pinned(ikey, now_ms)
        )

    # -- queries -----------------------------------------------------------------------------

    def eviction_order(self, now_ms: int, exclude: Iterable[bytes] = ()) -> list[RecordInfo]:
        """Records eviction may take, least recently used first."""
        skip = set(exclude)
        return [
            info
            for ikey, info in self._records.items()
            if ikey not in skip and not info.quarantined and not self.is_pinned(ikey, now_ms)
        ]

    def matching(self, flt: RecordFilter, now_ms: int, after: bytes = b"") -> list[RecordInfo]:
        """Records matching a filter in key order, starting after `after`."""
        found = [
            info
            for ikey, info in self._records.items()
            if ikey > after and flt.matches(info, now_ms)
        ]
        found.sort(key=lambda info: info.ikey)
        for info in found:
            info.pinned = self.is_pinned(info.ikey, now_ms)
        return found

    def quarantined_count(self) -> int:
        return sum(1 for info in self._records.values() if info.quarantined)
