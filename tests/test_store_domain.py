"""The store's domain in process, on a temporary LMDB directory: no gRPC, no servicers."""

from __future__ import annotations

import dataclasses
import os
import re
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from store_service.admin import StoreAdmin
from store_service.config import StoreConfig
from store_service.errors import (
    Aborted,
    AlreadyExists,
    Corrupt,
    InvalidRequest,
    NotFound,
    Overloaded,
    Precondition,
    StorageError,
)
from store_service.put_spec import PutSpec
from store_service.records import (
    Lease,
    RecordFilter,
    chunk_layout,
    normalize_namespace,
    prefix_scope,
    record_key,
)
from store_service.storage import now_ms
from store_service.store import CheckpointStore
from store_service.wire import LookupQuery, PutResult, StoreStats
from tandem_client import Checkpoint
from tandem_client.identity import block_hashes, scope_digest
from tandem_client.store_client import Attachment, payload_chunks
from tandem_wire.pb import store_pb2, tensors_pb2
from tests.conftest import flip_stored_byte, make_checkpoint, payload_crc

KiB = 1 << 10
CHUNK = 4 * KiB  # the smallest storage chunk: many chunks per record
EVERYTHING = RecordFilter()


def open_store(data_dir: Path, **settings: Any) -> CheckpointStore:
    settings.setdefault("chunk_bytes", CHUNK)
    return CheckpointStore(StoreConfig(data_dir=data_dir, **settings))


@pytest.fixture
def core(tmp_path: Path) -> Iterator[CheckpointStore]:
    store = open_store(tmp_path / "store", capacity_bytes=100 * KiB)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def admin(core: CheckpointStore) -> StoreAdmin:
    return StoreAdmin(core)


def put(core: CheckpointStore, ckpt: Checkpoint, piece: int = 3000, **options: Any) -> PutResult:
    """Puts ckpt in pieces that straddle the storage chunks (so the store re-chunks)."""
    spec = PutSpec.validated(ckpt.header_pb(), **options)
    return core.put(spec, payload_chunks(ckpt.all_tensors(), piece))


def payload(core: CheckpointStore, key: bytes, namespace: str = "", max_chunk: int = 0) -> bytes:
    record = core.open_record(namespace, key)
    pieces = list(core.read_payload(record, max_chunk))
    offsets = [offset for offset, _ in pieces]
    assert offsets == sorted(offsets) and (not pieces or offsets[0] == 0)
    return b"".join(data for _, data in pieces)


def keys(admin: StoreAdmin) -> set[bytes]:
    return {info.key for info in admin.list_records(EVERYTHING, 1000, "").records}


def test_put_get_round_trip_keeps_running_checksums_per_chunk(core: CheckpointStore) -> None:
    ckpt = make_checkpoint(
        b"round-trip",
        {"k_bf16": 10_000, "v_int8": 3 * CHUNK + 17, "empty_int8": 0},
        token_ids=[1, 2, 3],
        kind="generation",
    )
    ckpt.attachments.append(
        Attachment("test/features", [make_checkpoint(b"x", {"f_int8": 5000}).tensors[0]])
    )
    tensors = ckpt.all_tensors()
    sent = b"".join(bytes(t.data) for t in tensors)

    result = put(core, ckpt)
    assert (result.key, result.payload_bytes, result.replaced) == (ckpt.key, len(sent), False)

    record = core.open_record("", ckpt.key)
    assert record.header.token_count == 3 and record.header.attachments[0].schema == "test/features"
    # A stored chunk never spans two tensors; its CRC is its tensor's running CRC, so the
    # last chunk of each tensor holds that tensor's whole checksum.
    slots = chunk_layout([len(t.data) for t in tensors], CHUNK)
    assert len(record.chunk_crcs) == len(slots) == 3 + 4 + 0 + 2
    last_crc_of = {s.tensor: crc for s, crc in zip(slots, record.chunk_crcs, strict=True)}
    assert [last_crc_of.get(i, 0) for i in range(len(tensors))] == payload_crc(ckpt)

    assert payload(core, ckpt.key) == sent
    small = list(core.read_payload(record, max_chunk=1000))
    assert max(len(data) for _, data in small) == 1000
    assert b"".join(data for _, data in small) == sent

    replacement = make_checkpoint(b"round-trip", {"only_int8": 100})
    assert put(core, replacement).replaced
    assert payload(core, ckpt.key) == bytes(replacement.tensors[0].data)
    assert core.state.storage.entries("chunks") == 1  # the old record's chunks went with it


def test_bad_payloads_are_rejected_and_leave_nothing(
    core: CheckpointStore, admin: StoreAdmin
) -> None:
    ckpt = make_checkpoint(b"bad", {"a_int8": 3 * CHUNK})
    data = bytes(ckpt.tensors[0].data)
    spec = PutSpec.validated(ckpt.header_pb())
    flipped = bytearray(data)
    flipped[CHUNK + 5] ^= 1

    def stalls(after: int) -> Iterator[tuple[int, bytes]]:
        yield 0, data[:after]
        raise ConnectionError("the client went away")

    cases: list[tuple[type[Exception], str, Iterable[tuple[int, Any]]]] = [
        (InvalidRequest, "expected 0", [(1, data)]),
        (InvalidRequest, "more bytes than declared", [(0, data + b"x")]),
        (InvalidRequest, "payload ended", [(0, data[:-1])]),
        (InvalidRequest, "checksum mismatch", [(0, bytes(flipped))]),
        (ConnectionError, "went away", stalls(2 * CHUNK)),
    ]
    for error, message, chunks in cases:
        with pytest.raises(error, match=message):
            core.put(spec, chunks)
    admin.flush()  # aborted puts clean up on the writer thread
    stats = admin.stats()
    assert (stats.records, stats.chunk_entries, stats.pending_puts, stats.pending_bytes) == (
        0,
        0,
        0,
        0,
    )

    lying = make_checkpoint(b"lying", {"a_int8": 100})
    lying.tensors[0].crc32 = zlib.crc32(b"something else")
    with pytest.raises(InvalidRequest, match="checksum mismatch"):
        put(core, lying)
    with pytest.raises(InvalidRequest, match="kind"):
        PutSpec.validated(make_checkpoint(b"k", {"a_int8": 1}, kind="").header_pb())

    put(core, make_checkpoint(b"taken", {"a_int8": 10}))
    with pytest.raises(AlreadyExists):
        put(core, make_checkpoint(b"taken", {"a_int8": 20}), if_absent=True)
    assert len(payload(core, b"taken")) == 10
    # Refused at its commit (the key was taken while it streamed): a small put's chunks were
    # to be written in that very transaction, so none is left.
    late = make_checkpoint(b"race", {"a_int8": 30})
    session = core.begin_put(PutSpec.validated(late.header_pb(), if_absent=True))
    for offset, data in payload_chunks(late.tensors, 7):
        session.write(offset, data)
    put(core, make_checkpoint(b"race", {"a_int8": 40}))
    with pytest.raises(AlreadyExists):
        core.commit_put(session)
    admin.flush()
    assert admin.stats().chunk_entries == 2  # "taken" and the first "race", one chunk each
    assert len(payload(core, b"race")) == 40


def _prefix(core: CheckpointStore, tokens: list[int], trimmable: bool = True) -> bytes:
    scope = scope_digest("m@1", ["kv:plain"], "")
    key = bytes([len(tokens) % 251, int(trimmable)]) + scope[:14]
    ckpt = make_checkpoint(
        key,
        {"kv_bf16": 4 * len(tokens)},
        token_ids=tokens,
        model_id="m@1",
        trimmable=trimmable,
        block_size=16,
        block_hashes=block_hashes(tokens, 16, scope),
    )
    put(core, ckpt)
    return key


def _query(tokens: list[int], model: str = "m@1", namespace: str = "") -> LookupQuery:
    chain = block_hashes(tokens, 16, scope_digest(model, ["kv:plain"], namespace))
    return LookupQuery(namespace, model, ("kv:plain",), 16, tuple(chain), len(tokens))


def test_lookup_finds_the_longest_stored_prefix(core: CheckpointStore, admin: StoreAdmin) -> None:
    prompt = list(range(1000, 1200))
    short = _prefix(core, prompt[:48])
    long = _prefix(core, prompt[:130])
    exact_only = _prefix(core, prompt[:64], trimmable=False)

    hit = core.lookup(_query(prompt))
    # The 130-token record serves up to its last block boundary inside the query...
    assert (hit.found, hit.key, hit.matched_tokens, hit.record_tokens) == (True, long, 128, 130)
    # ...and a query ending where it ends at its exact length.
    assert core.lookup(_query(prompt[:130])).matched_tokens == 130

    admin.delete("", long, force=False)
    exact = core.lookup(_query(prompt))
    assert (exact.key, exact.matched_tokens, exact.trimmable) == (exact_only, 64, False)
    # A record that cannot be trimmed serves only its own length: 60 tokens get the 48.
    assert core.lookup(_query(prompt[:60])).key == short
    admin.delete("", exact_only, force=False)
    fallback = core.lookup(_query(prompt))
    assert (fallback.key, fallback.matched_tokens, fallback.record_tokens) == (short, 48, 48)

    assert not core.lookup(_query([7] * 40)).found
    assert not core.lookup(_query(prompt, model="other@2")).found
    assert not core.lookup(_query(prompt, namespace="tenant-b")).found
    generations = dataclasses.replace(_query(prompt), kind=tensors_pb2.RECORD_KIND_GENERATION)
    assert not core.lookup(generations).found

    for bad, message in [
        (dataclasses.replace(_query(prompt), block_hashes=()), "needs block_hashes"),
        (dataclasses.replace(_query(prompt), block_size=0), "positive block_size"),
        (dataclasses.replace(_query(prompt), token_count=17), "do not match"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            core.lookup(bad)
    stats = admin.stats()
    assert (stats.hits, stats.misses) == (5, 4)


def test_a_damaged_prefix_index_entry_is_never_served(core: CheckpointStore) -> None:
    """An index entry naming a record whose (checksummed) header does not hold that chain
    position is skipped and counted: the lookup misses rather than serve another prompt."""
    other = _prefix(core, list(range(5000, 5048)))
    query = _query(list(range(100, 148)))
    storage = core.state.storage
    namespace = normalize_namespace("")
    entry = prefix_scope(namespace, "m@1", ["kv:plain"], 16) + query.block_hashes[-1]
    with storage.env.begin(write=True) as txn:
        txn.put(entry, record_key(namespace, other), db=storage.db["prefix_index"])
    assert not core.lookup(query).found
    assert core.state.counters.bad_index_entries == 1
    assert core.lookup(_query(list(range(5000, 5048)))).key == other  # the record is fine


def test_eviction_takes_least_recently_used_unpinned_records_first(
    core: CheckpointStore, admin: StoreAdmin
) -> None:
    record = 20 * KiB  # the budget holds five
    for i in range(5):
        put(core, make_checkpoint(b"r%d" % i, {"kv_int8": record}))
    core.open_record("", b"r0")  # r0 becomes the most recently used
    lease = core.pin("", b"r1", ttl_s=60, holder="test", lease_id="")
    order = [info.key for info in core.state.index.eviction_order(now_ms())]
    assert order == [b"r2", b"r3", b"r4", b"r0"]  # oldest first; pinned r1 is not a candidate

    put(core, make_checkpoint(b"r5", {"kv_int8": 2 * record}))
    assert keys(admin) == {b"r0", b"r1", b"r4", b"r5"}
    stats = admin.stats()
    assert (stats.evictions, stats.evicted_bytes, stats.payload_bytes) == (2, 2 * record, 100 * KiB)

    # A put in flight holds its reservation: nothing else may take that room.
    session = core.begin_put(PutSpec.validated(make_checkpoint(b"slow", {"a": record}).header_pb()))
    assert (admin.stats().pending_puts, admin.stats().pending_bytes) == (1, record)
    assert b"r4" not in keys(admin)  # r4 made room for the reservation
    core.abort_put(session)
    assert admin.stats().pending_puts == 0

    core.pin("", b"r0", ttl_s=60, holder="test", lease_id="")  # 40 KiB pinned now
    with pytest.raises(Overloaded, match="pinned"):
        put(core, make_checkpoint(b"too-big", {"kv_int8": 3 * record + 1}))
    with pytest.raises(Overloaded, match="capacity"):
        put(core, make_checkpoint(b"huge", {"kv_int8": 100 * KiB + 1}))
    assert {b"r0", b"r1"} <= keys(admin)

    core.unpin("", b"r1", lease.lease_id)
    with pytest.raises(NotFound):
        core.unpin("", b"r1", lease.lease_id)
    put(core, make_checkpoint(b"fits", {"kv_int8": 3 * record + 1}))
    assert keys(admin) == {b"r0", b"fits"}  # r1, unpinned, and r5 made room


def test_flipped_byte_on_disk_is_corrupt_and_quarantined(tmp_path: Path) -> None:
    data_dir = tmp_path / "store"
    victim = make_checkpoint(b"victim", {"k_bf16": 3 * CHUNK, "v_int8": CHUNK})
    healthy = make_checkpoint(b"healthy", {"k_bf16": 2 * CHUNK})
    store = open_store(data_dir)
    put(store, victim)
    put(store, healthy)
    store.close()

    flip_stored_byte(data_dir, chunk=1, at=100)  # the victim's second (its id sorts first)

    store = open_store(data_dir)
    admin = StoreAdmin(store)
    try:
        record = store.open_record("", b"victim")
        received = bytearray()
        with pytest.raises(Corrupt, match="chunk 1"):
            for _, data in store.read_payload(record):
                received += data
        assert bytes(received) == bytes(victim.tensors[0].data)[:CHUNK]  # chunk 0 only

        with pytest.raises(Corrupt, match="quarantined"):
            store.open_record("", b"victim")
        with pytest.raises(NotFound):
            store.pin("", b"victim", ttl_s=0, holder="", lease_id="")
        assert admin.inspect("", b"victim").summary.quarantined
        assert payload(store, b"healthy") == bytes(healthy.tensors[0].data)
        stats = admin.stats()
        assert (stats.quarantined, stats.records, stats.chunk_entries) == (1, 1, 2)
    finally:
        store.close()

    store = open_store(data_dir)  # quarantine is on disk: it survives a restart
    admin = StoreAdmin(store)
    try:
        assert admin.stats().quarantined == 1
        assert admin.delete("", b"victim", force=False) == 0  # its chunks were already freed
        assert admin.stats().quarantined == 0
        with pytest.raises(NotFound):
            store.open_record("", b"victim")
    finally:
        store.close()


def test_delete_purge_list_and_stats(core: CheckpointStore, admin: StoreAdmin) -> None:
    for i in range(4):
        put(core, make_checkpoint(b"g%d" % i, {"kv_int8": 1000}, kind="generation"))
    put(core, make_checkpoint(b"p", {"kv_int8": 2000}, kind="prefix", namespace="t"))
    core.pin("", b"g0", ttl_s=60, holder="engine", lease_id="")
    payload(core, b"g1")
    with pytest.raises(NotFound):
        core.open_record("", b"missing")

    stats = admin.stats()
    assert (stats.records, stats.payload_bytes, stats.pinned_records) == (5, 6000, 1)
    assert (stats.puts, stats.gets, stats.hits, stats.misses) == (5, 1, 1, 1)
    assert stats.to_pb().pinned_records == 1

    first = admin.list_records(EVERYTHING, 2, "")
    second = admin.list_records(EVERYTHING, 2, first.next_page_token)
    last = admin.list_records(EVERYTHING, 2, second.next_page_token)
    paged = [r.key for page in (first, second, last) for r in page.records]
    assert sorted(paged) == sorted(keys(admin)) and len(paged) == 5 and not last.next_page_token
    assert [r.key for r in admin.list_records(RecordFilter(namespace="t"), 0, "").records] == [b"p"]
    for size, token in [(-1, ""), (0, "not-hex")]:
        with pytest.raises(InvalidRequest):
            admin.list_records(EVERYTHING, size, token)

    with pytest.raises(Precondition):
        admin.delete("", b"g0", force=False)
    with pytest.raises(NotFound):
        admin.delete("", b"missing", force=False)
    assert admin.inspect("", b"g0").summary.pinned

    generations = RecordFilter(kind=tensors_pb2.RECORD_KIND_GENERATION)
    dry = admin.purge(generations, include_pinned=False, dry_run=True)
    assert sorted(r.key for r in dry.removed) == [b"g1", b"g2", b"g3"] and len(keys(admin)) == 5
    gone = admin.purge(generations, include_pinned=False, dry_run=False)
    assert (gone.freed_bytes, keys(admin)) == (3000, {b"g0", b"p"})
    assert admin.delete("", b"g0", force=True) == 1000
    assert admin.purge(EVERYTHING, include_pinned=True, dry_run=False).freed_bytes == 2000
    admin.flush()
    stats = admin.stats()
    assert (stats.records, stats.payload_bytes, stats.chunk_entries, stats.pinned_records) == (
        0,
        0,
        0,
        0,
    )


def test_restart_keeps_records_leases_and_recency_and_collects_orphans(tmp_path: Path) -> None:
    data_dir = tmp_path / "store"
    store = open_store(data_dir, capacity_bytes=64 << 20)
    for name in (b"a", b"b", b"c"):
        put(store, make_checkpoint(name, {"kv_int8": 1000}))
        time.sleep(0.005)  # access times have millisecond resolution
    store.open_record("", b"a")  # recency: b, c, a
    lease = store.pin("", b"c", ttl_s=600, holder="engine", lease_id="")
    # A put whose chunks reached LMDB but never committed, as if the process had died.
    unfinished = make_checkpoint(b"unfinished", {"kv_int8": 9 << 20})
    session = store.begin_put(PutSpec.validated(unfinished.header_pb()))
    for offset, data in payload_chunks(unfinished.tensors, 1 << 20):
        session.write(offset, data)
    assert session.wrote_any
    store.close()

    store = open_store(data_dir, capacity_bytes=64 << 20)
    admin = StoreAdmin(store)
    try:
        stats = admin.stats()
        assert (stats.records, stats.orphans_collected, stats.chunk_entries) == (3, 1, 3)
        assert [x.lease_id for x in admin.inspect("", b"c").leases] == [lease.lease_id]
        order = [info.key for info in store.state.index.eviction_order(now_ms())]
        assert order == [b"b", b"a"]  # c is pinned
        assert payload(store, b"b") != b""
        # The refusal names the owner (here this process) and how to stop it.
        owner = re.escape(f"another store has {data_dir} open (pid {os.getpid()}): stop it first")
        with pytest.raises(StorageError, match=owner):
            open_store(data_dir)
    finally:
        store.close()


def test_stats_to_pb_is_complete() -> None:
    names = [f.name for f in dataclasses.fields(StoreStats)]
    assert sorted(names) == sorted(store_pb2.StatsResponse.DESCRIPTOR.fields_by_name)


def test_direct_read_leases_end_once_and_a_late_check_quarantines_nothing(
    tmp_path: Path,
) -> None:
    """A direct read's lease (store_service/direct_reads.py): its offsets hold the record's
    bytes in the data file; released once (True), then unknown (False); a check after the
    lease ended is Aborted, never Corrupt, so nothing is quarantined for a caller's timing;
    a lease nobody releases lapses on its own and keeps no transaction."""
    store = open_store(tmp_path / "store", capacity_bytes=1 << 20, direct_read_ttl_s=0.2)
    try:
        ckpt = make_checkpoint(b"direct", {"k": 50 * KiB, "v": 30 * KiB})
        put(store, ckpt)
        record = store.open_record("", b"direct")
        placement = store.direct.place(record)
        data = (tmp_path / "store" / "data.mdb").read_bytes()
        read = b"".join(
            data[o : o + n]
            for o, n in zip(placement.chunk_offsets, placement.chunk_lengths, strict=True)
        )
        assert read == payload(store, b"direct")
        store.direct.check(placement, record, store.quarantine)  # passes
        assert store.direct.release(placement.lease) is True
        assert store.direct.release(placement.lease) is False
        with pytest.raises(Aborted):
            store.direct.check(placement, record, store.quarantine)
        assert payload(store, b"direct") == read  # not quarantined
        unreleased = store.direct.place(record)
        deadline = time.monotonic() + 30
        while store.direct.counts() != (0, 1):
            assert time.monotonic() < deadline, "the lease never lapsed"
            time.sleep(0.01)
        assert store.direct.release(unreleased.lease) is False
        StoreAdmin(store).compact()  # needs every transaction ended: the lapsed one is
    finally:
        store.close()


def test_a_direct_read_answers_from_where_the_chunks_were_found_before(tmp_path: Path) -> None:
    """Where a record's chunks lie is learnt once (store_service/direct_reads.py): the next
    direct read answers from it, the same places holding the same bytes, and passes its
    check; a record replaced under its key is never placed from its predecessor's places
    (the old one is gone: Aborted; the new one's bytes are its own)."""
    store = open_store(tmp_path / "store", capacity_bytes=1 << 20)
    try:
        put(store, make_checkpoint(b"d", {"k": 50 * KiB, "v": 30 * KiB}))
        old = store.open_record("", b"d")
        placements = []
        for _ in range(2):
            placement = store.direct.place(old)
            store.direct.check(placement, old, store.quarantine)
            assert store.direct.release(placement.lease)
            placements.append(placement)
        assert placements[0].chunk_offsets == placements[1].chunk_offsets
        data = (tmp_path / "store" / "data.mdb").read_bytes()
        read = b"".join(
            data[o : o + n]
            for o, n in zip(placements[1].chunk_offsets, placements[1].chunk_lengths, strict=True)
        )
        assert read == payload(store, b"d")

        put(store, make_checkpoint(b"d", {"k": 40 * KiB, "v": 40 * KiB}))  # random anew
        with pytest.raises(Aborted):
            store.direct.place(old)
        new = store.open_record("", b"d")
        placement = store.direct.place(new)
        store.direct.check(placement, new, store.quarantine)
        assert store.direct.release(placement.lease)
        data = (tmp_path / "store" / "data.mdb").read_bytes()
        read = b"".join(
            data[o : o + n]
            for o, n in zip(placement.chunk_offsets, placement.chunk_lengths, strict=True)
        )
        assert read == payload(store, b"d")
    finally:
        store.close()


def _stored_leases(store: CheckpointStore) -> dict[str, bytes]:
    """Lease id -> the record key it protects, as LMDB holds them (not the index)."""
    db = store.state.storage.db

    def read(txn: Any) -> dict[str, bytes]:
        return {
            bytes(k).decode(): Lease.decode(bytes(k), bytes(v)).ikey
            for k, v in txn.cursor(db=db["leases"])
        }

    return store.state.storage.read(read)


def test_a_delete_takes_its_records_leases_and_no_other_even_in_a_file_older_than_lease_owners(
    tmp_path: Path,
) -> None:
    """Deleting a record drops its leases from LMDB through `lease_owners` (not by reading
    every lease); a file written before that table existed gets it at start-up."""
    data_dir = tmp_path / "store"
    store = open_store(data_dir, capacity_bytes=64 << 20)
    for name in (b"a", b"b"):
        put(store, make_checkpoint(name, {"kv_int8": 1000}))
    a1 = store.pin("", b"a", ttl_s=600, holder="engine", lease_id="")
    a2 = store.pin("", b"a", ttl_s=600, holder="engine", lease_id="")
    b1 = store.pin("", b"b", ttl_s=600, holder="engine", lease_id="")
    store.close()
    # As a store file of before the table: no `lease_owners` at all.
    env = lmdb.open(str(data_dir), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"lease_owners", txn=txn, dupsort=True), delete=True)
    env.close()

    store = open_store(data_dir, capacity_bytes=64 << 20)
    try:
        ikey_a, ikey_b = (store.open_record("", k).ikey for k in (b"a", b"b"))
        assert _stored_leases(store) == {
            a1.lease_id: ikey_a,
            a2.lease_id: ikey_a,
            b1.lease_id: ikey_b,
        }
        store.unpin("", b"a", a2.lease_id)
        assert StoreAdmin(store).delete("", b"a", force=True) > 0  # bytes freed
        assert _stored_leases(store) == {b1.lease_id: ikey_b}
    finally:
        store.close()
    store = open_store(data_dir, capacity_bytes=64 << 20)
    try:
        assert [x.lease_id for x in StoreAdmin(store).inspect("", b"b").leases] == [b1.lease_id]
    finally:
        store.close()
