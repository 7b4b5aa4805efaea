"""Operators' calls: list, inspect, delete, purge, stats, flush and compact."""

from __future__ import annotations

import time
from typing import Any

from store_service import tables
from store_service.errors import InvalidRequest, NotFound, Precondition
from store_service.records import (
    RecordFilter,
    RecordInfo,
    normalize_namespace,
    record_key,
)
from store_service.storage import now_ms
from store_service.store import CheckpointStore
from store_service.wire import Compaction, Inspection, Page, Purged, StoreStats
from tandem_wire.limits import MAX_PAGE_TOKEN_CHARS

MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100


class StoreAdmin:
    """The admin view of a CheckpointStore (which it shares, not owns)."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.state = store.state

    def list_records(self, flt: RecordFilter, page_size: int, page_token: str) -> Page:
        """Records matching flt in key order, after page_token; page_size 0 means 100.

        Raises:
            InvalidRequest: a negative page size or a malformed token.
        """
        if page_size < 0:
            raise InvalidRequest("page_size must not be negative")
        page_size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        if len(page_token) > MAX_PAGE_TOKEN_CHARS:
            raise InvalidRequest(f"page_token is longer than {MAX_PAGE_TOKEN_CHARS} characters")
        try:
            after = bytes.fromhex(page_token)
        except ValueError as exc:
            raise InvalidRequest("malformed page_token") from exc
        with self.state.mutex:
            found = self.state.index.matching(flt, now_ms(), after=after)
        page = found[:page_size]
        return Page(page, page[-1].ikey.hex() if len(found) > page_size else "")

    def inspect(self, namespace: str, key: bytes) -> Inspection:
        """A record's stored header, summary and leases (quarantined ones too).

        Raises:
            NotFound: no such record.
        """
        st = self.state
        namespace = normalize_namespace(namespace)
        ikey = record_key(namespace, key)
        live, quarantined = st.storage.read(
            lambda txn: tables.read_header(txn, st.storage.db, ikey)
        )
        raw = live or quarantined
        with st.mutex:
            info = st.index.get(ikey)
            if raw is None or info is None:
                raise NotFound(f"no record {key.hex()} in namespace {namespace!r}")
            info.pinned = st.index.is_pinned(ikey, now_ms())
            leases = st.index.leases_of(ikey)
        table = "headers" if live is not None else "quarantine"
        return Inspection(self.store.decode_header(ikey, raw, table), info, leases)

    def delete(self, namespace: str, key: bytes, force: bool) -> int:
        """Removes a record; returns the payload bytes freed.

        Raises:
            NotFound: no such record. Precondition: it is pinned and force is not set.
        """
        gone = self.delete_many(namespace, [key], force)
        if not gone:
            raise NotFound(f"no record {key.hex()} in namespace {normalize_namespace(namespace)!r}")
        return gone[0].payload_bytes

    def delete_many(self, namespace: str, keys: list[bytes], force: bool) -> list[RecordInfo]:
        """Removes the records of these keys that exist, in one transaction; returns them.

        Raises:
            Precondition: one is pinned and force is not set (nothing is removed).
        """
        st = self.state
        namespace = normalize_namespace(namespace)
        ikeys = list(dict.fromkeys(record_key(namespace, key) for key in keys))
        with st.mutex:
            gone = [info for info in map(st.index.get, ikeys) if info is not None]
            now = now_ms()
            if not force and any(st.index.is_pinned(info.ikey, now) for info in gone):
                raise Precondition("record is pinned by a lease; use force to delete it anyway")
            for info in gone:
                st.index.remove(info.ikey)
        if gone:
            self._delete_from_disk(gone)
        if self.store.tier is not None:  # a finished generation leaves both tiers
            for info in gone:
                self.store.tier.delete(info.ikey, namespace, info.payload_bytes)
        return gone

    def purge(self, flt: RecordFilter, include_pinned: bool, dry_run: bool) -> Purged:
        """Removes every record matching flt (pinned ones only with include_pinned)."""
        st = self.state
        now = now_ms()
        with st.mutex:
            gone = [
                info
                for info in st.index.matching(flt, now)
                if include_pinned or not st.index.is_pinned(info.ikey, now)
            ]
            if dry_run:
                return Purged(gone)
            for info in gone:
                st.index.remove(info.ikey)
        self._delete_from_disk(gone)
        return Purged(gone)

    def _delete_from_disk(self, gone: list[RecordInfo]) -> None:
        db = self.state.storage.db

        def remove_all(txn: Any) -> None:
            for info in gone:
                tables.delete_record(txn, db, info.ikey)

        self.state.storage.write(remove_all, sync=self.state.sync_on_commit)

    def stats(self) -> StoreStats:
        st = self.state
        storage, config = st.storage, st.config
        chunk_entries = storage.entries("chunks")
        direct_open, direct_lapsed = self.store.direct.counts()
        with st.mutex:
            c, index, now = st.counters, st.index, now_ms()
            return StoreStats(
                records=sum(1 for i in index.matching(RecordFilter(), now) if not i.quarantined),
                payload_bytes=index.used_bytes,
                capacity_bytes=config.capacity_bytes,
                map_size_bytes=storage.map_size,
                file_bytes=storage.file_bytes(),
                hits=c.hits,
                misses=c.misses,
                evictions=c.evictions,
                evicted_bytes=c.evicted_bytes,
                quarantined=index.quarantined_count() + storage.entries("damaged"),
                pinned_records=index.pinned_count(now),
                pending_puts=len(self.store.capacity.pending),
                pending_bytes=self.store.capacity.pending_bytes,
                chunk_entries=chunk_entries,
                orphans_collected=c.orphans_collected,
                puts=c.puts,
                gets=c.gets,
                sync_mode=config.sync_mode.value,
                chunk_bytes=config.chunk_bytes,
                map_resizes=storage.map_resizes,
                regions=self.store.regions.count(now),
                tier=self.store.tier.stats() if self.store.tier is not None else None,
                direct_reads=direct_open,
                direct_reads_lapsed=direct_lapsed,
            )

    def flush(self) -> float:
        """Durability barrier: persists access times, then syncs; returns the seconds taken."""
        start = time.perf_counter()
        self.store.maintenance.persist_access()
        self.state.storage.sync()
        if self.store.tier is not None:
            self.store.tier.flush()  # what was queued for the tier is there (or dropped)
        return time.perf_counter() - start

    def compact(self) -> Compaction:
        """Rewrites the LMDB file without its free pages."""
        start = time.perf_counter()
        before, after = self.state.storage.compact()
        return Compaction(before, after, time.perf_counter() - start)
