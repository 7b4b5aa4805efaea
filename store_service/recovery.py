"""Start-up: the in-memory index rebuilt from LMDB, stale leases dropped, orphans collected."""

from __future__ import annotations

import logging
from typing import Any

from store_service import tables
from store_service.records import RecordFilter, RecordInfo
from store_service.state import StoreState
from store_service.storage import now_ms

log = logging.getLogger(__name__)


def _set_aside_damage(state: StoreState, contents: tables.Contents) -> None:
    """Damaged header values leave the serving tables (the rest of the store is served);
    records of the format before header checksums are rewritten with one."""
    storage, db = state.storage, state.storage.db
    for damaged in contents.damaged:
        log.error(
            "record %s in %s is damaged (%s): set aside, its chunks collected",
            damaged.ikey.hex(),
            damaged.table,
            damaged.reason,
        )
    legacy = [record for record in contents.records if record.legacy]

    def repair(txn: Any) -> None:
        for damaged in contents.damaged:
            tables.set_aside(txn, db, damaged)
        for record in legacy:
            tables.rewrite(txn, db, record)

    if contents.damaged or legacy:
        storage.write(repair, sync=True)
    if legacy:
        log.warning(
            "rewrote %d records written before header checksums (their payload chunks keep "
            "their CRCs; the headers themselves could not be checked retroactively)",
            len(legacy),
        )
    state.counters.damaged += len(contents.damaged)


def recover(state: StoreState) -> None:
    """Loads every record, access time and live lease into the index; deletes the chunks
    of puts a crash cut short (`Counters.orphans_collected`)."""
    storage, index, db = state.storage, state.index, state.storage.db
    contents = storage.read(lambda txn: tables.load(txn, db))
    _set_aside_damage(state, contents)
    live_ids = set()
    for record in contents.records:
        record.last_access_ms = contents.access.get(record.ikey, record.created_ms)
        index.put(RecordInfo.of(record))
        live_ids.add(record.record_id)
    for info in sorted(index.matching(RecordFilter(), now_ms()), key=lambda i: i.last_access_ms):
        index.touch(info.ikey, info.last_access_ms)  # restore LRU order
    index.take_dirty_access()
    now = now_ms()
    stale, live = [], []
    for lease in contents.leases:
        if lease.expires_ms > now and index.get(lease.ikey) is not None:
            index.add_lease(lease)
            live.append(lease)
        else:
            stale.append(lease.lease_id)
    stale.extend(lease_id.decode(errors="replace") for lease_id in contents.bad_leases)

    def drop_stale(txn: Any) -> None:
        tables.delete_leases(txn, db, stale)
        tables.index_lease_owners(txn, db, live)

    storage.submit(drop_stale)
    state.next_record_id = max([contents.last_chunk_id, *live_ids]) + 1
    orphans = storage.write(lambda txn: tables.collect_orphans(txn, db, live_ids), sync=True)
    state.counters.orphans_collected = orphans
    if orphans:
        log.warning("collected chunks of %d interrupted puts", orphans)
    log.info("store opened: %d records, %d bytes", len(index), index.used_bytes)
