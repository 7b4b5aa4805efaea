"""The RPCs' typed requests and results with their from_pb/to_pb, and the bulk codecs.

Beside records.py (whose types carry their own from_pb/to_pb) and the servicer, this is
the only module that imports `*_pb2`: the domain (store.py, admin.py, capacity.py) takes
and returns these dataclasses. Put and Get payload chunks skip protobuf's copies
(tandem_wire.chunks): `parse_put_request` and `serialize_response` are the gRPC
(de)serializers installed for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from store_service.direct_reads import Placement
from store_service.errors import InvalidRequest
from store_service.records import (
    KIND_PREFIX,
    Lease,
    RecordInfo,
    RecordKind,
    StoredRecord,
    check_label,
    check_layout,
)
from store_service.regions import RegionLease, RegionRequest
from tandem_wire.chunks import decode_chunk
from tandem_wire.limits import MIN_GET_CHUNK_BYTES
from tandem_wire.pb import store_pb2

# -- Put ---------------------------------------------------------------------------------------

MALFORMED = object()


def parse_put_request(raw: bytes) -> Any:
    """PutRequest deserializer: a bare chunk becomes (offset, view) without protobuf's copies.

    Never raises: a message that cannot be parsed becomes MALFORMED, which `put_chunks`
    answers with INVALID_ARGUMENT (grpc would turn a raising deserializer into INTERNAL).
    """
    try:
        chunk = decode_chunk(raw)
        return chunk if chunk is not None else store_pb2.PutRequest.FromString(raw)
    except (ValueError, DecodeError):
        return MALFORMED


def put_header(messages: Iterator[Any]) -> store_pb2.PutHeader:
    """The header a Put stream must open with."""
    first = next(messages, None)
    if not isinstance(first, store_pb2.PutRequest) or not first.HasField("header"):
        raise InvalidRequest("the first message of a Put must be its header")
    return first.header


def put_chunks(messages: Iterable[Any]) -> Iterator[tuple[int, Any]]:
    """(offset, data) of each chunk after the header, whichever way it was parsed."""
    for message in messages:
        if isinstance(message, tuple):  # the fast path: see parse_put_request
            yield message
        elif isinstance(message, store_pb2.PutRequest) and message.HasField("chunk"):
            yield message.chunk.offset, message.chunk.data
        elif message is MALFORMED:
            raise InvalidRequest("a Put message could not be parsed")
        else:
            raise InvalidRequest("a Put carries one header, then only chunks")


class PutStreams:
    """The records of a PutMany stream, one at a time: (header, its chunks). A record's
    chunks end at the next header; the caller consumes them before asking for the next."""

    def __init__(self, messages: Iterator[Any]) -> None:
        self._messages = messages
        self._next: Any = None  # a header read past the end of the previous record

    def __iter__(self) -> Iterator[tuple[store_pb2.PutHeader, Iterator[tuple[int, Any]]]]:
        first = next(self._messages, None)
        if first is None:
            return
        self._next = first
        while self._next is not None:
            opening, self._next = self._next, None
            if not isinstance(opening, store_pb2.PutRequest) or not opening.HasField("header"):
                raise InvalidRequest("each record of a PutMany opens with its header")
            yield opening.header, put_chunks(self._chunks())

    def _chunks(self) -> Iterator[Any]:
        for message in self._messages:
            if isinstance(message, store_pb2.PutRequest) and message.HasField("header"):
                self._next = message
                return
            yield message


@dataclass(frozen=True)
class PutResult:
    key: bytes
    payload_bytes: int
    replaced: bool
    evicted: int
    lease_id: str

    def to_pb(self) -> store_pb2.PutResponse:
        return store_pb2.PutResponse(
            key=self.key,
            payload_bytes=self.payload_bytes,
            replaced=self.replaced,
            evicted=self.evicted,
            lease_id=self.lease_id,
        )


def serialize_response(message: Any) -> bytes:
    """Get response serializer: passes pre-encoded chunk bytes on; serializes messages."""
    return message if isinstance(message, bytes) else message.SerializeToString()


# -- Lookup ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LookupQuery:
    """A token sequence by its block-hash chain, and what a record must share to serve it."""

    namespace: str
    model_id: str
    layout: tuple[str, ...]
    block_size: int
    block_hashes: tuple[bytes, ...]
    token_count: int
    kind: RecordKind = KIND_PREFIX

    @classmethod
    def from_pb(cls, req: store_pb2.LookupRequest) -> LookupQuery:
        check_label("model_id", req.model_id)
        check_layout("layout", req.layout)
        return cls(
            namespace=req.namespace,
            model_id=req.model_id,
            layout=tuple(req.layout),
            block_size=req.block_size,
            block_hashes=tuple(bytes(h) for h in req.block_hashes),
            token_count=req.token_count,
            kind=req.kind or KIND_PREFIX,
        )


@dataclass(frozen=True)
class LookupResult:
    found: bool
    key: bytes = b""
    matched_tokens: int = 0
    record_tokens: int = 0
    trimmable: bool = False
    payload_bytes: int = 0

    def to_pb(self) -> store_pb2.LookupResponse:
        return store_pb2.LookupResponse(
            found=self.found,
            key=self.key,
            matched_tokens=self.matched_tokens,
            record_tokens=self.record_tokens,
            trimmable=self.trimmable,
            payload_bytes=self.payload_bytes,
        )


# -- Admin -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    records: list[RecordInfo]
    next_page_token: str

    def to_pb(self) -> store_pb2.ListResponse:
        return store_pb2.ListResponse(
            records=[r.to_pb() for r in self.records], next_page_token=self.next_page_token
        )


@dataclass(frozen=True)
class Inspection:
    record: StoredRecord
    summary: RecordInfo
    leases: list[Lease]

    def to_pb(self) -> store_pb2.InspectResponse:
        return store_pb2.InspectResponse(
            summary=self.summary.to_pb(),
            header=self.record.header,
            leases=[lease.to_pb() for lease in self.leases],
            chunk_count=len(self.record.chunk_crcs),
            chunk_bytes=self.record.chunk_bytes,
        )


@dataclass(frozen=True)
class Purged:
    removed: list[RecordInfo]

    @property
    def freed_bytes(self) -> int:
        return sum(x.payload_bytes for x in self.removed)

    def to_pb(self) -> store_pb2.PurgeResponse:
        return store_pb2.PurgeResponse(
            records=len(self.removed),
            freed_bytes=self.freed_bytes,
            removed=[x.to_pb() for x in self.removed],
        )


@dataclass(frozen=True)
class StoreStats:
    """Counters and sizes; the counters are per process lifetime."""

    records: int
    payload_bytes: int
    capacity_bytes: int
    map_size_bytes: int
    file_bytes: int
    hits: int
    misses: int
    evictions: int
    evicted_bytes: int
    quarantined: int
    pinned_records: int
    pending_puts: int
    pending_bytes: int
    chunk_entries: int
    orphans_collected: int
    puts: int
    gets: int
    sync_mode: str
    chunk_bytes: int
    map_resizes: int
    auth_failures: int = 0  # calls refused UNAUTHENTICATED (with --auth-file)
    regions: int = 0  # shared-memory regions registered now
    tier: TierStats | None = None  # with --tier
    direct_reads: int = 0  # direct Gets' leases open now
    direct_reads_lapsed: int = 0  # ... and those that lapsed unreleased since start

    def to_pb(self) -> store_pb2.StatsResponse:
        fields = {**vars(self), "tier": self.tier.to_pb() if self.tier is not None else None}
        return store_pb2.StatsResponse(**fields)


@dataclass(frozen=True)
class TierStats:
    """What one store did with the shared tier since it started (store.proto's TierStats)."""

    up: bool
    durability: str
    hits: int
    misses: int
    read_bytes: int
    read_seconds: float
    written: int
    written_bytes: int
    write_seconds: float
    queue_depth: int
    queued_bytes: int
    dropped: int
    errors: int
    damaged: int
    quota_refusals: int
    deleted: int

    def to_pb(self) -> store_pb2.TierStats:
        return store_pb2.TierStats(**vars(self))


@dataclass(frozen=True)
class Compaction:
    file_bytes_before: int
    file_bytes_after: int
    seconds: float

    def to_pb(self) -> store_pb2.CompactResponse:
        return store_pb2.CompactResponse(**vars(self))


def get_piece_bytes(request: store_pb2.GetRequest) -> int:
    """The piece size a Get answers in: 0 (the stored chunks) or at least MIN_GET_CHUNK_BYTES.

    Raises:
        InvalidRequest: a smaller positive size (one read would become that many messages).
    """
    n = request.max_chunk_bytes
    if 0 < n < MIN_GET_CHUNK_BYTES:
        raise InvalidRequest(
            f"max_chunk_bytes must be 0 (the stored chunks) or >= {MIN_GET_CHUNK_BYTES}, got {n}"
        )
    return n


# -- Regions -----------------------------------------------------------------------------------


def region_request(request: store_pb2.RegisterRegionRequest) -> RegionRequest:
    r = request
    return RegionRequest(
        r.name, r.size_bytes, r.ttl_seconds, r.ticket, r.registration, r.proof, r.data_file
    )


def direct_placement_pb(placement: Placement) -> store_pb2.DirectPlacement:
    return store_pb2.DirectPlacement(
        lease=placement.lease,
        file_device=placement.file.device,
        file_inode=placement.file.inode,
        chunk_offsets=placement.chunk_offsets,
        chunk_lengths=placement.chunk_lengths,
        expires_at_unix_ms=placement.expires_ms,
    )


def region_lease_pb(lease: RegionLease) -> store_pb2.RegisterRegionResponse:
    return store_pb2.RegisterRegionResponse(
        expires_at_unix_ms=lease.expires_ms,
        ticket=lease.ticket,
        region_socket=lease.socket,
        ticket_expires_at_unix_ms=lease.ticket_expires_ms,
        registration=lease.registration,
        store_instance=lease.instance,
        superseded_copies=lease.superseded_copies,
    )


def parse_handover(raw: bytes) -> bytes:
    """The ticket of a RegionHandover sent over the region socket (b"" if malformed)."""
    try:
        return store_pb2.RegionHandover.FromString(raw).ticket
    except DecodeError:
        return b""


def handover_reply(error: str, data_file_refused: str = "", data_file: bool = False) -> bytes:
    reply = store_pb2.RegionHandoverReply(
        error=error, data_file_refused=data_file_refused, data_file=data_file
    )
    return reply.SerializeToString()
