"""The checkpoint store's domain: puts, gets, prefix lookup, leases, capacity and admin.

No network here: the servicers translate wire messages into these calls. LMDB is only
touched through storage.LmdbStorage; the in-memory RecordIndex (guarded by one mutex)
answers questions about sizes, recency and pins.
"""

from __future__ import annotations

import logging
import secrets
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from store_service.config import StoreConfig, SyncMode
from store_service.errors import (
    Aborted,
    AlreadyExists,
    Corrupt,
    InvalidRequest,
    NotFound,
    Overloaded,
    Precondition,
)
from store_service.index import Lease, RecordIndex
from store_service.put_session import PutSession
from store_service.records import (
    ChunkSlot,
    PutSpec,
    RecordFilter,
    RecordInfo,
    StoredRecord,
    chain_lengths,
    chunk_key,
    normalize_namespace,
    prefix_scope,
    record_id_prefix,
    record_key,
)
from store_service.storage import LmdbStorage, collect_orphans, delete_prefix, now_ms
from tandem_wire.pb import store_pb2, tensors_pb2

log = logging.getLogger(__name__)

_ACCESS = struct.Struct(">q")
Encoder = Callable[[int, memoryview], Any]


def _copy(offset: int, view: memoryview) -> tuple[int, bytes]:
    return offset, bytes(view)


MAINTENANCE_PERIOD_S = 1.0


@dataclass
class PutResult:
    key: bytes
    payload_bytes: int
    replaced: bool
    evicted: int
    lease_id: str


@dataclass
class LookupResult:
    found: bool
    key: bytes = b""
    matched_tokens: int = 0
    record_tokens: int = 0
    trimmable: bool = False


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    puts: int = 0
    gets: int = 0
    orphans_collected: int = 0


class CheckpointStore:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        map_size = config.map_size_bytes or config.capacity_bytes * 5 // 4 + (64 << 20)
        self.storage = LmdbStorage(config.data_dir, map_size)
        self.index = RecordIndex()
        self.counters = Counters()
        self._mutex = threading.RLock()
        self._reserved = 0
        self._pending: dict[int, int] = {}  # record id -> bytes, for puts in flight
        self._next_id = 1
        self._recover()
        self._stop = threading.Event()
        self._last_sync = time.monotonic()
        self._maintenance = threading.Thread(
            target=self._maintain, name="store-maintenance", daemon=True
        )
        self._maintenance.start()

    # -- start-up ----------------------------------------------------------------------------

    def _recover(self) -> None:
        db = self.storage.db

        def load(txn: Any) -> tuple[list[StoredRecord], dict[bytes, int], list[Lease], int]:
            records = []
            for table in ("headers", "quarantine"):
                for _, raw in txn.cursor(db=db[table]):
                    records.append(StoredRecord.decode(raw))
            access = {bytes(k): _ACCESS.unpack(v)[0] for k, v in txn.cursor(db=db["access"])}
            leases = [Lease.decode(k, v) for k, v in txn.cursor(db=db["leases"])]
            cursor = txn.cursor(db=db["chunks"])
            last = struct.unpack(">Q", cursor.key()[:8])[0] if cursor.last() else 0
            return records, access, leases, last

        records, access, leases, last_chunk_id = self.storage.read(load)
        live_ids = set()
        for record in records:
            record.last_access_ms = access.get(record.ikey, record.created_ms)
            self.index.put(RecordInfo.of(record))
            live_ids.add(record.record_id)
        for info in sorted(
            self.index.matching(RecordFilter(), now_ms()), key=lambda i: i.last_access_ms
        ):
            self.index.touch(info.ikey, info.last_access_ms)  # restore LRU order
        self.index.take_dirty_access()
        now = now_ms()
        stale = []
        for lease in leases:
            if lease.expires_ms > now and self.index.get(lease.ikey) is not None:
                self.index.add_lease(lease)
            else:
                stale.append(lease.lease_id.encode())

        def drop_stale(txn: Any) -> None:
            for lease_id in stale:
                txn.delete(lease_id, db=db["leases"])

        self.storage.submit(drop_stale)
        self._next_id = max([last_chunk_id, *live_ids]) + 1
        self.counters.orphans_collected = self.storage.write(
            lambda txn: collect_orphans(txn, db["chunks"], live_ids), sync=True
        )
        if self.counters.orphans_collected:
            log.warning("collected chunks of %d interrupted puts", self.counters.orphans_collected)
        log.info("store opened: %d records, %d bytes", len(self.index), self.index.used_bytes)

    # -- put ---------------------------------------------------------------------------------

    def begin_put(self, header: store_pb2.PutHeader) -> PutSession:
        spec = PutSpec.from_pb(header)
        capacity = self.config.capacity_bytes
        if spec.payload_bytes > capacity:
            raise Overloaded(
                f"checkpoint of {spec.payload_bytes} bytes exceeds the store's "
                f"capacity of {capacity} bytes"
            )
        with self._mutex:
            existing = self.index.get(spec.ikey)
            if spec.if_absent and existing is not None:
                raise AlreadyExists("a record with this key exists")
            freeable = existing.payload_bytes if existing is not None else 0
            self._make_room(spec.payload_bytes - freeable, exclude=spec.ikey)
            self._reserved += spec.payload_bytes
            record_id = self._next_id
            self._next_id += 1
            self._pending[record_id] = spec.payload_bytes
        return PutSession(spec, record_id, self.config.chunk_bytes, self._write_chunks)

    def _write_chunks(self, items: list[tuple[bytes, bytes]]) -> Any:
        chunks = self.storage.db["chunks"]

        def write(txn: Any) -> None:
            for key, value in items:
                txn.put(key, value, db=chunks)

        return self.storage.submit(write)

    def _make_room(self, nbytes: int, exclude: bytes) -> None:
        """Evicts least-recently-used unpinned records until nbytes more fit (mutex held)."""
        capacity = self.config.capacity_bytes
        excess = self.index.used_bytes + self._reserved + nbytes - capacity
        if excess <= 0:
            return
        victims = []
        for info in self.index.eviction_order(now_ms(), exclude=[exclude]):
            if excess <= 0:
                break
            victims.append(info)
            excess -= info.payload_bytes
        if excess > 0:
            raise Overloaded(
                f"no room for {nbytes} bytes: the rest of the store is pinned or being written"
            )
        for info in victims:
            self.index.remove(info.ikey)
            self.counters.evictions += 1
            self.counters.evicted_bytes += info.payload_bytes
            log.info(
                "evicting %s/%s (%d bytes)", info.namespace, info.key.hex(), info.payload_bytes
            )

        def evict(txn: Any) -> None:
            for info in victims:
                self._delete_in_txn(txn, info.ikey)

        self.storage.submit(evict)

    def commit_put(self, session: PutSession) -> PutResult:
        session.finish()
        spec = session.spec
        now = now_ms()
        record = StoredRecord(
            session.record_id,
            now,
            spec.payload_bytes,
            session.chunk_bytes,
            session.chunk_crcs,
            spec.header,
            last_access_ms=now,
        )
        lease = None
        if spec.pin_ttl_s:
            # A writer that re-pins on every Put (an engine checkpointing a generation) keeps
            # one lease, renewed, rather than piling up a new one per Put.
            with self._mutex:
                same_holder = [
                    x.lease_id
                    for x in self.index.leases_of(spec.ikey)
                    if spec.pin_holder and x.holder == spec.pin_holder
                ]
            lease = Lease(
                same_holder[0] if same_holder else secrets.token_hex(8),
                spec.ikey,
                spec.pin_holder,
                now + 1000 * min(spec.pin_ttl_s, self.config.max_lease_s),
            )
        db = self.storage.db

        def commit(txn: Any) -> StoredRecord | None:
            old_raw = txn.get(spec.ikey, db=db["headers"])
            if old_raw is not None and spec.if_absent:
                raise AlreadyExists("a record with this key exists")
            old = self._delete_in_txn(txn, spec.ikey, keep_leases=True)
            txn.put(spec.ikey, record.encode(), db=db["headers"])
            for index_key in record.index_keys():
                txn.put(index_key, spec.ikey, db=db["prefix_index"])
            txn.put(spec.ikey, _ACCESS.pack(now), db=db["access"])
            if lease is not None:
                txn.put(lease.lease_id.encode(), lease.encode(), db=db["leases"])
            return old

        def publish(old: StoredRecord | None) -> None:
            with self._mutex:
                self.index.put(RecordInfo.of(record))
                if lease is not None:
                    self.index.add_lease(lease)
                self.counters.puts += 1

        try:
            old = self.storage.write(
                commit, sync=self.config.sync_mode == SyncMode.COMMIT, on_commit=publish
            )
        finally:
            self._release(session)
        return PutResult(
            spec.key, spec.payload_bytes, old is not None, 0, lease.lease_id if lease else ""
        )

    def abort_put(self, session: PutSession) -> None:
        """Forgets a put that failed or was cancelled; its chunks are deleted."""
        session.drain()
        if session.wrote_any:
            prefix = record_id_prefix(session.record_id)
            chunks = self.storage.db["chunks"]
            self.storage.submit(lambda txn: delete_prefix(txn, chunks, prefix))
        self._release(session)

    def _release(self, session: PutSession) -> None:
        with self._mutex:
            if self._pending.pop(session.record_id, None) is not None:
                self._reserved -= session.spec.payload_bytes

    # -- get ---------------------------------------------------------------------------------

    def open_record(self, namespace: str, key: bytes, count: bool = True) -> StoredRecord:
        """The header of a record (it becomes the most recently used)."""
        namespace = normalize_namespace(namespace)
        ikey = record_key(namespace, key)
        db = self.storage.db

        def read(txn: Any) -> tuple[bytes | None, bytes | None]:
            return txn.get(ikey, db=db["headers"]), txn.get(ikey, db=db["quarantine"])

        raw, quarantined = self.storage.read(read)
        with self._mutex:
            if raw is None:
                if count:
                    self.counters.misses += 1
                if quarantined is not None:
                    raise Corrupt("record is quarantined: its stored bytes failed a checksum")
                raise NotFound(f"no record {key.hex()} in namespace {namespace!r}")
            if count:
                self.counters.hits += 1
                self.counters.gets += 1
            self.index.touch(ikey, now_ms())
        return StoredRecord.decode(raw)

    def read_payload(
        self, record: StoredRecord, max_chunk: int = 0, encode: Encoder = _copy
    ) -> Iterator[Any]:
        """Yields the payload as encode(offset, bytes) pieces, each stored chunk verified
        before anything of it leaves. encode runs inside the read transaction on a view of
        LMDB's own pages, so the one copy it makes is the only one."""
        chunks = self.storage.db["chunks"]
        crc = 0
        for slot, expected in zip(record.slots, record.chunk_crcs, strict=True):
            key = chunk_key(record.record_id, slot.index)
            prev = 0 if slot.starts_tensor else crc
            step = max_chunk or slot.length

            def read(
                txn: Any,
                key: bytes = key,
                prev: int = prev,
                expected: int = expected,
                slot: ChunkSlot = slot,
                step: int = step,
            ) -> list[Any] | None | int:
                buf = txn.get(key, db=chunks)
                if buf is None:
                    return None
                if len(buf) != slot.length or zlib.crc32(buf, prev) != expected:
                    return -1
                return [
                    encode(slot.offset + i, buf[i : i + step]) for i in range(0, slot.length, step)
                ]

            pieces = self.storage.read(read, buffers=True)
            if pieces is None:
                raise Aborted("the record was replaced or removed while it was being read")
            if pieces == -1:
                self.quarantine(record, f"chunk {slot.index} failed its checksum")
                raise Corrupt(
                    f"stored chunk {slot.index} of {record.header.key.hex()} failed "
                    "its checksum; the record is quarantined"
                )
            crc = expected
            yield from pieces  # type: ignore[misc]

    def quarantine(self, record: StoredRecord, reason: str) -> None:
        db = self.storage.db
        ikey = record.ikey

        def move(txn: Any) -> None:
            current = txn.get(ikey, db=db["headers"])
            if current is None or StoredRecord.decode(current).record_id != record.record_id:
                return  # already replaced or removed
            self._delete_in_txn(txn, ikey)
            record.quarantined = True
            txn.put(ikey, record.encode(), db=db["quarantine"])

        def publish(_: None) -> None:
            with self._mutex:
                if record.quarantined:
                    self.index.put(RecordInfo.of(record))

        self.storage.write(move, sync=True, on_commit=publish)
        log.error("quarantined %s/%s: %s", record.header.namespace, record.header.key.hex(), reason)

    # -- lookup ------------------------------------------------------------------------------

    def lookup(self, req: store_pb2.LookupRequest) -> LookupResult:
        namespace = normalize_namespace(req.namespace)
        hashes = list(req.block_hashes)
        if not hashes:
            raise InvalidRequest("lookup needs block_hashes")
        if req.block_size <= 0:
            raise InvalidRequest("lookup needs a positive block_size")
        if len(hashes) != -(-req.token_count // req.block_size):
            raise InvalidRequest("block_hashes do not match token_count and block_size")
        kind = req.kind or tensors_pb2.RECORD_KIND_PREFIX
        scope = prefix_scope(namespace, req.model_id, list(req.layout), req.block_size)
        lengths = chain_lengths(req.block_size, req.token_count, len(hashes))
        index_db = self.storage.db["prefix_index"]

        def candidates(txn: Any) -> list[tuple[int, list[bytes]]]:
            found = []
            cursor = txn.cursor(db=index_db)
            for i in range(len(hashes) - 1, -1, -1):
                if cursor.set_key(scope + bytes(hashes[i])):
                    found.append((i, [bytes(v) for v in cursor.iternext_dup()]))
            return found

        for i, ikeys in self.storage.read(candidates):
            with self._mutex:
                for ikey in ikeys:
                    info = self.index.get(ikey)
                    if info is None or info.quarantined or info.kind != kind:
                        continue
                    self.counters.hits += 1
                    self.index.touch(ikey, now_ms())
                    return LookupResult(
                        True, info.key, lengths[i], info.token_count, info.trimmable
                    )
        with self._mutex:
            self.counters.misses += 1
        return LookupResult(False)

    # -- leases ------------------------------------------------------------------------------

    def pin(self, namespace: str, key: bytes, ttl_s: int, holder: str, lease_id: str) -> Lease:
        namespace = normalize_namespace(namespace)
        ikey = record_key(namespace, key)
        ttl = min(ttl_s or self.config.default_lease_s, self.config.max_lease_s)
        with self._mutex:
            info = self.index.get(ikey)
            if info is None or info.quarantined:
                raise NotFound(f"no record {key.hex()} in namespace {namespace!r}")
            if lease_id and not any(x.lease_id == lease_id for x in self.index.leases_of(ikey)):
                raise NotFound(f"no lease {lease_id!r} on this record")
            lease = Lease(lease_id or secrets.token_hex(8), ikey, holder, now_ms() + 1000 * ttl)
            self.index.add_lease(lease)
        leases = self.storage.db["leases"]
        self.storage.write(lambda txn: txn.put(lease.lease_id.encode(), lease.encode(), db=leases))
        return lease

    def unpin(self, namespace: str, key: bytes, lease_id: str) -> None:
        ikey = record_key(normalize_namespace(namespace), key)
        with self._mutex:
            if self.index.remove_lease(ikey, lease_id) is None:
                raise NotFound(f"no lease {lease_id!r} on this record")
        leases = self.storage.db["leases"]
        self.storage.write(lambda txn: txn.delete(lease_id.encode(), db=leases))

    # -- admin -------------------------------------------------------------------------------

    def list_records(
        self, flt: RecordFilter, page_size: int, page_token: str
    ) -> tuple[list[RecordInfo], str]:
        if page_size < 0:
            raise InvalidRequest("page_size must not be negative")
        page_size = min(page_size or 100, 1000)
        try:
            after = bytes.fromhex(page_token)
        except ValueError as exc:
            raise InvalidRequest("malformed page_token") from exc
        with self._mutex:
            found = self.index.matching(flt, now_ms(), after=after)
        page = found[:page_size]
        token = page[-1].ikey.hex() if len(found) > page_size else ""
        return page, token

    def inspect(self, namespace: str, key: bytes) -> tuple[StoredRecord, RecordInfo, list[Lease]]:
        namespace = normalize_namespace(namespace)
        ikey = record_key(namespace, key)
        db = self.storage.db
        raw = self.storage.read(
            lambda txn: txn.get(ikey, db=db["headers"]) or txn.get(ikey, db=db["quarantine"])
        )
        with self._mutex:
            info = self.index.get(ikey)
            if raw is None or info is None:
                raise NotFound(f"no record {key.hex()} in namespace {namespace!r}")
            info.pinned = self.index.is_pinned(ikey, now_ms())
            return StoredRecord.decode(raw), info, self.index.leases_of(ikey)

    def delete(self, namespace: str, key: bytes, force: bool) -> int:
        namespace = normalize_namespace(namespace)
        ikey = record_key(namespace, key)
        with self._mutex:
            info = self.index.get(ikey)
            if info is None:
                raise NotFound(f"no record {key.hex()} in namespace {namespace!r}")
            if not force and self.index.is_pinned(ikey, now_ms()):
                raise Precondition("record is pinned by a lease; use force to delete it anyway")
            self.index.remove(ikey)
        self.storage.write(
            lambda txn: self._delete_in_txn(txn, ikey),
            sync=self.config.sync_mode == SyncMode.COMMIT,
        )
        return info.payload_bytes

    def purge(self, flt: RecordFilter, include_pinned: bool, dry_run: bool) -> list[RecordInfo]:
        now = now_ms()
        with self._mutex:
            gone = [
                info
                for info in self.index.matching(flt, now)
                if include_pinned or not self.index.is_pinned(info.ikey, now)
            ]
            if dry_run:
                return gone
            for info in gone:
                self.index.remove(info.ikey)

        def remove_all(txn: Any) -> None:
            for info in gone:
                self._delete_in_txn(txn, info.ikey)

        self.storage.write(remove_all, sync=self.config.sync_mode == SyncMode.COMMIT)
        return gone

    def stats(self) -> store_pb2.StatsResponse:
        chunk_entries = self.storage.entries("chunks")
        with self._mutex:
            c = self.counters
            return store_pb2.StatsResponse(
                records=sum(
                    1 for _ in self.index.matching(RecordFilter(), now_ms()) if not _.quarantined
                ),
                payload_bytes=self.index.used_bytes,
                capacity_bytes=self.config.capacity_bytes,
                map_size_bytes=self.storage.map_size,
                file_bytes=self.storage.file_bytes(),
                hits=c.hits,
                misses=c.misses,
                evictions=c.evictions,
                evicted_bytes=c.evicted_bytes,
                quarantined=self.index.quarantined_count(),
                pinned_records=self.index.pinned_count(now_ms()),
                pending_puts=len(self._pending),
                pending_bytes=sum(self._pending.values()),
                chunk_entries=chunk_entries,
                orphans_collected=c.orphans_collected,
                puts=c.puts,
                gets=c.gets,
                sync_mode=self.config.sync_mode.value,
                chunk_bytes=self.config.chunk_bytes,
                map_resizes=self.storage.map_resizes,
            )

    def flush(self) -> float:
        start = time.perf_counter()
        self._persist_access()
        self.storage.sync()
        return time.perf_counter() - start

    def compact(self) -> tuple[int, int]:
        return self.storage.compact()

    # -- shared helpers ----------------------------------------------------------------------

    def _delete_in_txn(
        self, txn: Any, ikey: bytes, keep_leases: bool = False
    ) -> StoredRecord | None:
        """Removes a record, its chunks and index entries in one transaction."""
        db = self.storage.db
        table = "headers"
        raw = txn.get(ikey, db=db[table])
        if raw is None:
            table = "quarantine"
            raw = txn.get(ikey, db=db[table])
        if raw is None:
            return None
        record = StoredRecord.decode(raw)
        delete_prefix(txn, db["chunks"], record_id_prefix(record.record_id))
        for index_key in record.index_keys():
            txn.delete(index_key, ikey, db=db["prefix_index"])
        txn.delete(ikey, db=db[table])
        txn.delete(ikey, db=db["access"])
        if not keep_leases:
            # Scan rather than ask the index: it may already have forgotten the record.
            stale = [k for k, v in txn.cursor(db=db["leases"]) if Lease.decode(k, v).ikey == ikey]
            for lease_id in stale:
                txn.delete(lease_id, db=db["leases"])
        return record

    def _persist_access(self) -> None:
        with self._mutex:
            dirty = self.index.take_dirty_access()
            expired = self.index.expired_leases(now_ms())
            for lease in expired:
                self.index.remove_lease(lease.ikey, lease.lease_id)
        if not dirty and not expired:
            return
        db = self.storage.db

        def write(txn: Any) -> None:
            for ikey, ms in dirty.items():
                if txn.get(ikey, db=db["headers"]) is not None:
                    txn.put(ikey, _ACCESS.pack(ms), db=db["access"])
            for lease in expired:
                txn.delete(lease.lease_id.encode(), db=db["leases"])

        self.storage.submit(write)

    def _maintain(self) -> None:
        while not self._stop.wait(MAINTENANCE_PERIOD_S):
            try:
                self._persist_access()
                if (
                    self.config.sync_mode == SyncMode.PERIODIC
                    and time.monotonic() - self._last_sync >= self.config.sync_interval_s
                ):
                    self.storage.sync()
                    self._last_sync = time.monotonic()
            except Exception:  # keep maintaining; the next round retries
                log.exception("store maintenance failed")

    def close(self) -> None:
        self._stop.set()
        self._maintenance.join()
        self._persist_access()
        self.storage.close()
