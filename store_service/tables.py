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

from store_service.errors import Corrupt, InvalidRequest
from store_service.records import Lease, StoredRecord, record_id_prefix

Tables = dict[str, Any]
ACCESS = struct.Struct(">q")  # last access, unix ms


@dataclass(frozen=True)
class Damaged:
    """A header value that failed its checksum or did not parse, where it was found."""

    table: str
    ikey: bytes
    raw: bytes
    reason: str


@dataclass
class Contents:
    """Everything start-up needs from the tables."""

    records: list[StoredRecord]  # live and quarantined, each verified
    access: dict[bytes, int]
    leases: list[Lease]
    last_chunk_id: int
    damaged: list[Damaged]
    bad_leases: list[bytes]  # lease ids whose value failed its checksum


def load(txn: Any, db: Tables) -> Contents:
    records, damaged = [], []
    for table in ("headers", "quarantine"):
        for key, raw in txn.cursor(db=db[table]):
            ikey = bytes(key)
            try:
                record = StoredRecord.decode(raw)
                if record.ikey != ikey:
                    raise Corrupt("record header names another key than it is stored under")
            except (Corrupt, InvalidRequest) as exc:
                damaged.append(Damaged(table, ikey, bytes(raw), str(exc)))
                continue
            records.append(record)
    access = {}
    for key, value in txn.cursor(db=db["access"]):
        if len(value) == ACCESS.size:  # a damaged time is forgotten: the record looks new
            access[bytes(key)] = ACCESS.unpack(value)[0]
    leases, bad_leases = [], []
    for key, value in txn.cursor(db=db["leases"]):
        try:
            leases.append(Lease.decode(key, value))
        except Corrupt:
            bad_leases.append(bytes(key))
    cursor = txn.cursor(db=db["chunks"])
    last = struct.unpack(">Q", cursor.key()[:8])[0] if cursor.last() else 0
    return Contents(records, access, leases, last, damaged, bad_leases)


def set_aside(txn: Any, db: Tables, damaged: Damaged) -> None:
    """Moves a damaged header value into `damaged`, out of the tables that serve."""
    txn.put(damaged.ikey, damaged.raw, db=db["damaged"])
    txn.delete(damaged.ikey, db=db[damaged.table])
    txn.delete(damaged.ikey, db=db["access"])


def rewrite(txn: Any, db: Tables, record: StoredRecord) -> None:
    """Stores a record's header again in the current format (legacy records at start-up)."""
    table = "quarantine" if record.quarantined else "headers"
    txn.put(record.ikey, record.encode(), db=db[table])


def read_header(txn: Any, db: Tables, ikey: bytes) -> tuple[bytes | None, bytes | None]:
    """A record's encoded header from `headers`, and from `quarantine` or `damaged` (at most
    one of the two is not None)."""
    set_apart = txn.get(ikey, db=db["quarantine"]) or txn.get(ikey, db=db["damaged"])
    return txn.get(ikey, db=db["headers"]), set_apart


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
        txn.delete(ikey, db=db["damaged"])
        return None
    try:
        record = StoredRecord.decode(raw)
    except Corrupt:  # its chunks can't be found from it: they are orphans from now on
        txn.delete(ikey, db=db[table])
        txn.delete(ikey, db=db["access"])
        return None
    delete_prefix(txn, db["chunks"], record_id_prefix(record.record_id))
    for index_key in record.index_keys():
        txn.delete(index_key, ikey, db=db["prefix_index"])
    txn.delete(ikey, db=db[table])
    txn.delete(ikey, db=db["access"])
    if not keep_leases:
        # From the table, not the index: the index may already have forgotten the record.
        # (Reading every lease here made each delete cost O(leases): 43k lease decodes for
        # 1.6k deletes in an 8-stream checkpointed decode, a third of the store's CPU.)
        owners = txn.cursor(db=db["lease_owners"])
        if owners.set_key(ikey):
            for lease_id in list(owners.iternext_dup()):
                txn.delete(lease_id, db=db["leases"])
            txn.delete(ikey, db=db["lease_owners"])  # all of its ids
    return record


def is_current(txn: Any, db: Tables, record: StoredRecord) -> bool:
    """Whether `headers` still holds this very record (not a replacement, not nothing).
    A chunk missing while its record is current was lost, not overtaken by a change: a
    replace or delete removes the header and the chunks in one transaction."""
    current = txn.get(record.ikey, db=db["headers"])
    try:
        return current is not None and StoredRecord.decode(current).record_id == record.record_id
    except Corrupt:
        return False


def quarantine_record(txn: Any, db: Tables, record: StoredRecord) -> StoredRecord | None:
    """Moves a record to `quarantine`, freeing its chunks; returns it as now stored, or None
    if it was already replaced or removed."""
    if not is_current(txn, db, record):
        return None
    delete_record(txn, db, record.ikey)
    quarantined = dataclasses.replace(record, quarantined=True)
    txn.put(record.ikey, quarantined.encode(), db=db["quarantine"])
    return quarantined


def put_lease(txn: Any, db: Tables, lease: Lease) -> None:
    lease_id = lease.lease_id.encode()
    txn.put(lease_id, lease.encode(), db=db["leases"])
    txn.put(lease.ikey, lease_id, db=db["lease_owners"])  # a duplicate pair is stored once


def delete_leases(txn: Any, db: Tables, lease_ids: list[str]) -> None:
    for text in lease_ids:
        lease_id = text.encode()
        raw = txn.get(lease_id, db=db["leases"])
        if raw is None:
            continue
        try:
            txn.delete(Lease.decode(lease_id, raw).ikey, lease_id, db=db["lease_owners"])
        except Corrupt:
            pass  # a damaged lease names no record; the next start's rebuild drops its entry
        txn.delete(lease_id, db=db["leases"])


def index_lease_owners(txn: Any, db: Tables, leases: list[Lease]) -> None:
    """`lease_owners` made again from the live leases (every start: a store file written
    before the table existed gets it, and a damaged lease's stray entry goes)."""
    txn.drop(db["lease_owners"], delete=False)
    for lease in leases:
        txn.put(lease.ikey, lease.lease_id.encode(), db=db["lease_owners"])


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
