"""The same-host Gets (docs/store.md): a payload copied into the caller's region, or placed for
the caller to read straight out of the data file (direct_reads.py). Each answers False, having
sent nothing, when the Get should take the next route instead (the servicer streams last)."""

from __future__ import annotations

import logging
import time
from collections.abc import Generator

import grpc

from store_service.errors import (
    Aborted,
    Corrupt,
    InvalidRequest,
    NotFound,
    Overloaded,
    Precondition,
)
from store_service.metrics import TRANSFERS, TransferPath
from store_service.records import StoredRecord
from store_service.region_copy import copy_in_parts, progress_part_bytes
from store_service.regions import Region
from store_service.storage import now_ms
from store_service.store import CheckpointStore
from store_service.wire import direct_placement_pb
from tandem_wire.auth import current
from tandem_wire.pb import store_pb2
from tandem_wire.tls import is_loopback_peer

log = logging.getLogger("tandem.store.direct")

Answers = Generator[store_pb2.GetResponse, None, bool]


def caller(context: grpc.ServicerContext) -> str:
    """Whose regions a call may name: its principal's (auth), and only from this host."""
    if not is_loopback_peer(context.peer()):
        raise Precondition("shared-memory regions are for callers on the store's host")
    principal = current()
    return principal.name if principal is not None else ""


def get_into_region(
    store: CheckpointStore, request: store_pb2.GetRequest, namespace: str, owner: str
) -> Answers:
    """Writes the payload into the caller's region and answers header + placement;
    returns False (sending nothing) when it does not fit and may be streamed instead.
    Progressive: the header first, then a progress message per verified part."""
    started = time.perf_counter()
    region = store.regions.get(owner, request.region, now_ms(), request.region_registration)
    parts: Generator[int, None, None] | None = None
    try:
        record = store.open_record(namespace, request.key)
        offset, span = request.region_offset, request.region_bytes
        if request.stream_if_larger and not region.fits(offset, span, record.payload_bytes):
            return False
        part_bytes = progress_part_bytes(record.payload_bytes) if request.progressive else 0
        parts = _copies(store, record, region, offset, span, part_bytes)
        if request.progressive:
            yield store_pb2.GetResponse(header=record.header)
            for verified in parts:
                progress = store_pb2.RegionProgress(verified_bytes=verified)
                yield store_pb2.GetResponse(progress=progress)
        else:
            # Verified into the region before anything is answered: a damaged chunk is
            # DATA_LOSS, never a header saying the bytes are there.
            for _ in parts:
                pass
    finally:
        if parts is not None:
            parts.close()  # a caller gone mid-copy: the part being copied ends first
        store.regions.done(region)
    TRANSFERS.get(TransferPath.REGION, time.perf_counter() - started, record.payload_bytes)
    if not request.progressive:
        yield store_pb2.GetResponse(header=record.header)
    placed = store_pb2.RegionPlacement(
        region=region.name, offset=offset, payload_bytes=record.payload_bytes
    )
    yield store_pb2.GetResponse(placed=placed)
    return True


def get_direct(
    store: CheckpointStore, request: store_pb2.GetRequest, namespace: str, owner: str
) -> Answers:
    """A direct Get (direct_reads.py): the header, where the chunks lie in the data file
    (under a lease), then the whole payload as verified once every chunk passed its check.
    False (nothing sent): the caller's region did not take the data file, or the lease table
    is full; the Get goes through the region instead."""
    started = time.perf_counter()
    region = store.regions.get(owner, request.region, now_ms(), request.region_registration)
    try:
        given = region.data_file
    finally:
        store.regions.done(region)
    if not given or not store.direct.enabled:
        return False
    record = store.open_record(namespace, request.key)
    try:
        placement = store.direct.place(record)
    except Overloaded:
        return False
    except Corrupt as exc:
        store.quarantine(record, str(exc))
        raise
    placed = time.perf_counter()
    try:
        yield store_pb2.GetResponse(header=record.header)
        yield store_pb2.GetResponse(direct=direct_placement_pb(placement))
        sent = time.perf_counter()
        store.direct.check(placement, record, store.quarantine)
        log.debug(  # where a direct Get's time went (bench/hit_floor_bench.py reads this)
            "direct Get phases (ms): placed %.1f, sent %.1f, checked %.1f (%d chunks)",
            (placed - started) * 1e3,
            (sent - placed) * 1e3,
            (time.perf_counter() - sent) * 1e3,
            len(placement.chunk_offsets),
        )
    except BaseException:
        # No verdict will be sent (a bad chunk, or the caller went away): nothing may be
        # read under the lease, so it ends now rather than at its TTL.
        store.direct.release(placement.lease)
        raise
    progress = store_pb2.RegionProgress(verified_bytes=record.payload_bytes)
    yield store_pb2.GetResponse(progress=progress)
    TRANSFERS.get(TransferPath.DIRECT, time.perf_counter() - started, record.payload_bytes)
    return True


# Reads one GetRecords call may name (a checkpoint chain has at most 16 segments).
MAX_RECORD_READS = 64


def get_records_into_region(
    store: CheckpointStore, request: store_pb2.GetRecordsRequest, namespace: str, owner: str
) -> store_pb2.GetRecordsResponse:
    """Store.GetRecords: each read's payload copied into the caller's region at its offset and
    verified, one after another, answered in one message (a Get a record costs a call and a
    stream of two messages, most of a small record's time: docs/performance.md)."""
    if len(request.reads) > MAX_RECORD_READS:
        raise InvalidRequest(f"at most {MAX_RECORD_READS} reads a call, not {len(request.reads)}")
    region = store.regions.get(owner, request.region, now_ms(), request.region_registration)
    answer = store_pb2.GetRecordsResponse()
    try:
        for read in request.reads:
            outcome = answer.records.add()
            started = time.perf_counter()
            try:
                record = store.open_record(namespace, read.key)
                offset, span = read.region_offset, read.region_bytes
                if not region.fits(offset, span, record.payload_bytes):
                    outcome.larger = True
                    continue
                for _ in _copies(store, record, region, offset, span):
                    pass  # verified into the region before it is answered
            except (NotFound, Aborted):
                outcome.missing = True
                continue
            except Corrupt:  # quarantined (copy_in_parts did, or it was already)
                outcome.damaged = True
                continue
            outcome.header.CopyFrom(record.header)
            seconds = time.perf_counter() - started
            TRANSFERS.get(TransferPath.REGION, seconds, record.payload_bytes)
    finally:
        store.regions.done(region)
    return answer


def _copies(
    store: CheckpointStore,
    record: StoredRecord,
    region: Region,
    offset: int,
    span: int,
    part_bytes: int = 0,
) -> Generator[int, None, None]:
    """The record's payload copied into the region at offset (region_copy.copy_in_parts)."""
    return copy_in_parts(
        store.state.storage,
        record,
        region,
        offset,
        span,
        store.quarantine,
        store.regions.copy_threads,
        part_bytes=part_bytes,
    )
