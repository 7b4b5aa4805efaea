"""The checkpoint store's data plane: put, get, prefix lookup, pin and unpin.

No network and no protobuf messages here: the servicer converts requests into the typed
dataclasses of records.py and wire.py. LMDB is reached through storage.LmdbStorage with
the transaction bodies of tables.py; the in-memory index (under the state's mutex)
answers questions about sizes, recency and pins. The budget is capacity.py's, start-up
recovery.py's, the operators' calls admin.py's.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from store_service import tables
from store_service.capacity import Capacity, Maintenance
from store_service.config import StoreConfig
from store_service.direct_reads import DirectReads
from store_service.errors import Aborted, AlreadyExists, Corrupt, InvalidRequest, NotFound
from store_service.map_warmer import MapWarmer
from store_service.put_session import InflightBudget, PutSession
from store_service.put_spec import PutSpec
from store_service.records import (
    KIND_PREFIX,
    ChunkSlot,
    Lease,
    RecordInfo,
    StoredRecord,
    chain_lengths,
    check_label,
    chunk_key,
    normalize_namespace,
    prefix_scope,
    record_id_prefix,
    record_key,
)
from store_service.recovery import recover
from store_service.region_copy import copy_threads
from store_service.region_socket import RegionSocket, default_address
from store_service.regions import HandoverAnswer, RegionLimits, Regions
from store_service.state import StoreState
from store_service.storage import now_ms
from store_service.tier import SharedTier
from store_service.wire import LookupQuery, LookupResult, PutResult
from tandem_wire.checksum import crc32

log = logging.getLogger(__name__)

Encoder = Callable[[int, memoryview], Any]


def copy_piece(offset: int, view: memoryview) -> tuple[int, bytes]:
    """The default Encoder: (offset, the bytes)."""
    return offset, bytes(view)


class CheckpointStore:
    """One data directory's records, opened (and recovered) on construction."""

    tier: SharedTier | None = None  # the shared tier (tier/tiered_store.py sets one)

    def __init__(self, config: StoreConfig) -> None:
        self.state = StoreState(config)
        try:
            recover(self.state)
        except BaseException:
            self.state.storage.close()  # the directory lock and the writer thread
            raise
        self.capacity = Capacity(self.state)
        self.put_budget = InflightBudget()  # bytes all Puts together queue at the writer
        self.maintenance = Maintenance(self.state, idle=lambda: not self.capacity.pending)
        self.maintenance.start()
        # Same-host callers' shared memory (regions.py), handed over on region_socket.py's.
        limits = RegionLimits.within_fds(config.max_regions_per_principal, config.max_regions)
        self.regions = Regions(copy_threads(config.region_copy_threads), limits)
        self.region_socket = None
        if config.region_socket != "off":
            address = config.region_socket or default_address()
            self.region_socket = RegionSocket(address, self._hand_over)
            self.regions.socket = address
        # Same-host callers of every namespace may read the data file themselves.
        self.direct = DirectReads(
            self.state.storage,
            config.direct_read_ttl_s,
            config.max_direct_reads,
            self.regions.copy_threads,
        )
        # Prefixes' pages mapped for region Gets, and their places kept for direct ones.
        self.warmer = MapWarmer(self.state.storage, self.direct.remember)
        if self.direct.enabled:
            self.regions.open_data_file = self.direct.open_file

    @property
    def config(self) -> StoreConfig:
        return self.state.config

    def _hand_over(self, ticket: bytes, fd: int, peer: str) -> HandoverAnswer:
        return self.regions.hand_over(ticket, fd, peer, now_ms())

    # -- put ---------------------------------------------------------------------------------

    def put(self, spec: PutSpec, chunks: Iterable[tuple[int, Any]]) -> PutResult:
        """Stores a checkpoint whose payload arrives as (offset, bytes) pieces, in order.

        Nothing is visible until every byte has arrived and matched its checksum; any
        failure (or the caller giving up) deletes what was written.

        Raises:
            InvalidRequest: a gap, overrun, short payload or checksum mismatch.
            AlreadyExists: spec.if_absent and the key is taken.
            Overloaded: no room under the budget.
        """
        session = self.begin_put(spec)
        try:
            for offset, data in chunks:
                session.write(offset, data)
            return self.commit_put(session)
        except BaseException:
            self.abort_put(session)
            raise

    def begin_put(self, spec: PutSpec) -> PutSession:
        """Reserves room (evicting if needed) and a record id for a put."""
        self.capacity.check_budget(spec.payload_bytes)
        with self.state.mutex:
            existing = self.state.index.get(spec.ikey)
            if spec.if_absent and existing is not None:
                raise AlreadyExists("a record with this key exists")
            freeable = existing.payload_bytes if existing is not None else 0
            record_id = self.capacity.reserve(spec.ikey, spec.payload_bytes, freeable)
        return PutSession(
            spec, record_id, self.config.chunk_bytes, self._write_chunks, self.put_budget
        )

    def _write_chunks(self, items: list[tuple[bytes, bytes]]) -> Any:
        chunks = self.state.storage.db["chunks"]

        def write(txn: Any) -> None:
            for key, value in items:
                txn.put(key, value, db=chunks)

        return self.state.storage.submit(write)

    def commit_put(self, session: PutSession) -> PutResult:
        """Makes a complete put visible in one transaction, replacing any old record."""
        unwritten = session.finish()
        st, spec, now = self.state, session.spec, now_ms()
        record = StoredRecord(
            session.record_id,
            now,
            spec.payload_bytes,
            session.chunk_bytes,
            session.chunk_crcs,
            spec.header,
            last_access_ms=now,
        )
        lease = self._lease_on_commit(spec, now) if spec.pin_ttl_s else None
        db = st.storage.db

        def commit(txn: Any) -> StoredRecord | None:
            if spec.if_absent and tables.read_header(txn, db, spec.ikey)[0] is not None:
                raise AlreadyExists("a record with this key exists")
            old = tables.delete_record(txn, db, spec.ikey, keep_leases=True)
            for chunk_key_, value in unwritten:
                txn.put(chunk_key_, value, db=db["chunks"])
            tables.write_record(txn, db, record, lease)
            return old

        def publish(old: StoredRecord | None) -> None:
            with st.mutex:
                st.index.put(RecordInfo.of(record))
                if lease is not None:
                    st.index.add_lease(lease)
                st.counters.puts += 1

        try:
            old = st.storage.write(commit, sync=st.sync_on_commit, on_commit=publish)
        finally:
            self.capacity.release(session.record_id)
        if spec.header.kind == KIND_PREFIX and self.regions.count(now):
            self.warmer.warm(record)
        return PutResult(
            spec.key, spec.payload_bytes, old is not None, 0, lease.lease_id if lease else ""
        )

    def _lease_on_commit(self, spec: PutSpec, now: int) -> Lease:
        # A writer that re-pins on every Put (an engine checkpointing a generation) keeps
        # one lease, renewed, rather than piling up a new one per Put.
        with self.state.mutex:
            same_holder = [
                x.lease_id
                for x in self.state.index.leases_of(spec.ikey)
                if spec.pin_holder and x.holder == spec.pin_holder
            ]
        return Lease(
            same_holder[0] if same_holder else secrets.token_hex(8),
            spec.ikey,
            spec.pin_holder,
            now + 1000 * min(spec.pin_ttl_s, self.config.max_lease_s),
        )

    def abort_put(self, session: PutSession) -> None:
        """Forgets a put that failed or was cancelled; its chunks are deleted."""
        session.drain()
        if session.wrote_any:
            prefix = record_id_prefix(session.record_id)
            chunks = self.state.storage.db["chunks"]
            self.state.storage.submit(lambda txn: tables.delete_prefix(txn, chunks, prefix))
        self.capacity.release(session.record_id)

    # -- get ---------------------------------------------------------------------------------

    def open_records(
        self, namespace: str, keys: Sequence[bytes]
    ) -> list[StoredRecord | NotFound | Corrupt]:
        """Each key's record, or why there is none, in the keys' order (Store.GetHeaders)."""
        out: list[StoredRecord | NotFound | Corrupt] = []
        for key in keys:
            try:
                out.append(self.open_record(namespace, key))
            except (NotFound, Corrupt) as exc:
                out.append(exc)
        return out

    def open_record(self, namespace: str, key: bytes) -> StoredRecord:
        """The header of a record (it becomes the most recently used).

        Raises:
            NotFound: no such record. Corrupt: it is quarantined.
        """
        st = self.state
        namespace = normalize_namespace(namespace)
        ikey = record_key(namespace, key)
        raw, quarantined = st.storage.read(lambda txn: tables.read_header(txn, st.storage.db, ikey))
        with st.mutex:
            if raw is None:
                st.counters.misses += 1
                if quarantined is not None:
                    raise Corrupt("record is quarantined: its stored bytes failed a checksum")
                raise NotFound(f"no record {key.hex()} in namespace {namespace!r}")
            st.counters.hits += 1
            st.counters.gets += 1
            st.index.touch(ikey, now_ms())
        return self.decode_header(ikey, raw)

    def local_record(self, ikey: bytes) -> StoredRecord:
        """The stored header under ikey, without counting a hit or touching it.

        Raises:
            NotFound: none (or only a quarantined one). Corrupt: it is damaged.
        """
        st = self.state
        raw, _ = st.storage.read(lambda txn: tables.read_header(txn, st.storage.db, ikey))
        if raw is None:
            raise NotFound("no such record")
        return self.decode_header(ikey, raw)

    def decode_header(self, ikey: bytes, raw: bytes, table: str = "headers") -> StoredRecord:
        """A stored header, verified; one that fails is set aside (`damaged`), leaves the
        index and raises Corrupt: its bytes are never served."""
        try:
            return StoredRecord.decode(raw)
        except Corrupt as exc:
            st = self.state
            damaged = tables.Damaged(table, ikey, bytes(raw), str(exc))
            st.storage.write(lambda txn: tables.set_aside(txn, st.storage.db, damaged), sync=True)
            with st.mutex:
                st.index.remove(ikey)
                st.counters.damaged += 1
            log.error("record %s is damaged (%s): set aside", ikey.hex(), exc)
            raise Corrupt(
                f"the record's stored header is damaged ({exc}); it is set aside"
            ) from exc

    def read_payload(
        self, record: StoredRecord, max_chunk: int = 0, encode: Encoder = copy_piece
    ) -> Iterator[Any]:
        """Yields the payload as encode(offset, bytes) pieces, each stored chunk verified
        before anything of it leaves. encode runs inside the read transaction on a view of
        LMDB's own pages, so the one copy it makes is the only one.

        Raises:
            Corrupt: a stored chunk failed its checksum or is missing while its record is
                unchanged (the record is quarantined).
            Aborted: the record was replaced or removed while being read.
        """
        storage = self.state.storage
        chunks = storage.db["chunks"]
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
                    # Lost (the record is still the same one) or overtaken by a change.
                    return -2 if tables.is_current(txn, storage.db, record) else None
                if len(buf) != slot.length or crc32(buf, prev) != expected:
                    return -1
                return [
                    encode(slot.offset + i, buf[i : i + step]) for i in range(0, slot.length, step)
                ]

            pieces = storage.read(read, buffers=True)
            if pieces is None:
                raise Aborted("the record was replaced or removed while it was being read")
            if pieces == -2:
                self.quarantine(record, f"chunk {slot.index} is missing")
                raise Corrupt(
                    f"stored chunk {slot.index} of {record.header.key.hex()} is missing; "
                    "the record is quarantined"
                )
            if pieces == -1:
                self.quarantine(record, f"chunk {slot.index} failed its checksum")
                raise Corrupt(
                    f"stored chunk {slot.index} of {record.header.key.hex()} failed "
                    "its checksum; the record is quarantined"
                )
            crc = expected
            yield from pieces  # type: ignore[misc]

    def quarantine(self, record: StoredRecord, reason: str) -> None:
        """Moves a record whose bytes failed a checksum out of service (its chunks freed)."""
        st = self.state

        def publish(moved: StoredRecord | None) -> None:
            if moved is not None:
                with st.mutex:
                    st.index.put(RecordInfo.of(moved))

        st.storage.write(
            lambda txn: tables.quarantine_record(txn, st.storage.db, record),
            sync=True,
            on_commit=publish,
        )
        log.error("quarantined %s/%s: %s", record.header.namespace, record.header.key.hex(), reason)

    # -- lookup ------------------------------------------------------------------------------

    def lookup(self, query: LookupQuery) -> LookupResult:
        """The record serving the longest prefix of the query's chain; a miss is found=False.

        Raises:
            InvalidRequest: an empty chain, or one that disagrees with the token count.
        """
        st = self.state
        namespace = normalize_namespace(query.namespace)
        hashes = query.block_hashes
        if not hashes:
            raise InvalidRequest("lookup needs block_hashes")
        if query.block_size <= 0:
            raise InvalidRequest("lookup needs a positive block_size")
        if len(hashes) != -(-query.token_count // query.block_size):
            raise InvalidRequest("block_hashes do not match token_count and block_size")
        scope = prefix_scope(namespace, query.model_id, list(query.layout), query.block_size)
        lengths = chain_lengths(query.block_size, query.token_count, len(hashes))
        db = st.storage.db
        for i, ikeys in st.storage.read(
            lambda txn: tables.prefix_candidates(txn, db, scope, hashes)
        ):
            with st.mutex:
                for ikey in ikeys:
                    info = st.index.get(ikey)
                    if info is None or info.quarantined or info.kind != query.kind:
                        continue
                    if scope + hashes[i] not in info.index_keys:
                        # A damaged index entry naming another record: never served.
                        st.counters.bad_index_entries += 1
                        log.warning("prefix index entry names %r, whose header disagrees", ikey)
                        continue
                    st.counters.hits += 1
                    st.index.touch(ikey, now_ms())
                    return LookupResult(
                        True,
                        info.key,
                        lengths[i],
                        info.token_count,
                        info.trimmable,
                        info.payload_bytes,
                    )
        with st.mutex:
            st.counters.misses += 1
        return LookupResult(False)

    # -- leases ------------------------------------------------------------------------------

    def pin(self, namespace: str, key: bytes, ttl_s: int, holder: str, lease_id: str) -> Lease:
        """Takes a lease (ttl 0: the default), or renews lease_id.

        Raises:
            NotFound: no such record, or no such lease on it.
        """
        st = self.state
        namespace = normalize_namespace(namespace)
        ikey = record_key(namespace, key)
        check_label("holder", holder)
        check_label("lease_id", lease_id)
        ttl = min(ttl_s or self.config.default_lease_s, self.config.max_lease_s)
        with st.mutex:
            info = st.index.get(ikey)
            if info is None or info.quarantined:
                raise NotFound(f"no record {key.hex()} in namespace {namespace!r}")
            if lease_id and not any(x.lease_id == lease_id for x in st.index.leases_of(ikey)):
                raise NotFound(f"no lease {lease_id!r} on this record")
            lease = Lease(lease_id or secrets.token_hex(8), ikey, holder, now_ms() + 1000 * ttl)
            st.index.add_lease(lease)
        st.storage.write(lambda txn: tables.put_lease(txn, st.storage.db, lease))
        return lease

    def unpin(self, namespace: str, key: bytes, lease_id: str) -> None:
        """Releases a lease. Raises NotFound if the record has no such lease."""
        st = self.state
        ikey = record_key(normalize_namespace(namespace), key)
        check_label("lease_id", lease_id)
        with st.mutex:
            if st.index.remove_lease(ikey, lease_id) is None:
                raise NotFound(f"no lease {lease_id!r} on this record")
        st.storage.write(lambda txn: tables.delete_leases(txn, st.storage.db, [lease_id]))

    def close(self) -> None:
        """Stops maintenance, finishes queued writes, syncs and closes LMDB."""
        self.maintenance.stop()
        self.warmer.close()
        if self.region_socket is not None:
            self.region_socket.close()
        self.regions.close()
        self.direct.close()
        self.state.storage.close()
