"""What a record is across the named tables: the transaction bodies that load, write, move
and remove records, leases and access times.

Each runs inside `LmdbStorage.read` / `write` (storage.py opens the tables and owns the
transactions); `db` is `LmdbStorage.db`, table name -> handle. Write bodies may run more
than once (a full map is grown and the transaction retried), so they only touch LMDB.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from store_service.records import Lease, StoredRecord, record_id_prefix

Tables = dict[str, Any]
ACCESS = struct.Struct(">q")  # last access, unix ms


@dataclass
class Contents:
    """Everything start-up needs from the tables."""

    records: list[StoredRecord]  # live and quarantined
    access: dict[bytes, int]
    leases: list[Lease]
    last_chunk_id: int


def load(txn: Any, db: Tables) -> Contents:
    records = []
    for table in ("headers", "quarantine"):
        for _, raw in txn.cursor(db=db[table]):
            records.append(StoredRecord.decode(raw))
    access = {bytes(k): ACCESS.unpack(v)[0] for k, v in txn.cursor(db=db["access"])}
    leases = [Lease.decode(k, v) for k, v in txn.cursor(db=db["leases"])]
    cursor = txn.cursor(db=db["chunks"])
    last = struct.unpack(">Q", cursor.key()[:8])[0] if cursor.last() else 0
    return Contents(records, access, leases, last)


def read_header(txn: Any, db: Tables, ikey: bytes) -> tuple[bytes | None, bytes | None]:
    """A record's encoded header from `headers`, and from `quarantine` (one is None)."""
    return txn.get(ikey, db=db["headers"]), txn.get(ikey, db=db["quarantine"])


def prefix_candidates(
    txn: Any, db: Tables, scope: bytes, hashes: Sequence[bytes]
) -> list[tuple[int, list[bytes]]]:
    """(chain position, record keys indexed there), from the longest position down."""
    found = []
    cursor = txn.cursor(db=db["prefix_index"])
    for i in range(len(hashes) - 1, -1, -1):
        if cursor.set_key(scope + hashes[i]):
            found.append((i, [bytes(v) for v in cursor.iternext_dup()]))
    return found


def write_record(txn: Any, db: Tables, record: StoredRecord, lease: Lease | None) -> None:
    """Writes a committed record: header, prefix-index entries, access time, lease."""
    ikey = record.ikey
    txn.put(ikey, record.encode(), db=db["headers"])
    for index_key in record.index_keys():
        txn.put(index_key, ikey, db=db["prefix_index"])
    txn.put(ikey, ACCESS.pack(record.last_access_ms), db=db["access"])
    if lease is not None:
        put_lease(txn, db, lease)


def delete_record(
    txn: Any, db: Tables, ikey: bytes, keep_leases: bool = False
) -> StoredRecord | None:
    """Removes a record (live or quarantined), its chunks and index entries; returns it."""
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


def quarantine_record(txn: Any, db: Tables, record: StoredRecord) -> StoredRecord | None:
    """Moves a record to `quarantine`, freeing its chunks; returns it as now stored, or None
    if it was already replaced or removed."""
    current = txn.get(record.ikey, db=db["headers"])
    if current is None or StoredRecord.decode(current).record_id != record.record_id:
        return None
    delete_record(txn, db, record.ikey)
    quarantined = dataclasses.replace(record, quarantined=True)
    txn.put(record.ikey, quarantined.encode(), db=db["quarantine"])
    return quarantined


def put_lease(txn: Any, db: Tables, lease: Lease) -> None:
    txn.put(lease.lease_id.encode(), lease.encode(), db=db["leases"])


def delete_leases(txn: Any, db: Tables, lease_ids: list[str]) -> None:
    for lease_id in lease_ids:
        txn.delete(lease_id.encode(), db=db["leases"])


def write_access(txn: Any, db: Tables, last_access: dict[bytes, int]) -> None:
    """Persists last-access times of records that still exist."""
    for ikey, ms in last_access.items():
        if txn.get(ikey, db=db["headers"]) is not None:
            txn.put(ikey, ACCESS.pack(ms), db=db["access"])


def delete_prefix(txn: Any, table: Any, prefix: bytes) -> int:
    """Deletes every key starting with prefix (a record's chunks) in a write transaction."""
    cursor = txn.cursor(db=table)
    deleted = 0
    if cursor.set_range(prefix):
        while bytes(cursor.key()).startswith(prefix) and cursor.delete():
            deleted += 1
    return deleted


def collect_orphans(txn: Any, db: Tables, live_ids: set[int]) -> int:
    """Deletes chunks whose record id no header references (puts cut short by a crash)."""
    chunks = db["chunks"]
    cursor = txn.cursor(db=chunks)
    orphans = 0
    found = cursor.first()
    while found:
        record_id = struct.unpack(">Q", bytes(cursor.key())[:8])[0]
        if record_id not in live_ids:
            orphans += 1
            delete_prefix(txn, chunks, record_id_prefix(record_id))
        found = cursor.set_range(record_id_prefix(record_id + 1))
    return orphans
