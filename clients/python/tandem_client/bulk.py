"""The bulk paths of Put and Get, shared by the sync and asyncio store clients: the payload
cut into chunks (views, no copy), hand-encoded wire chunks (tandem_wire.chunks), and the
assembly of a Get stream into one buffer with each tensor's CRC checked as its bytes land."""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tandem_client.errors import DataLoss
from tandem_client.records import Checkpoint, PutItem, Tensor
from tandem_wire.checksum import crc32
from tandem_wire.chunks import decode_chunk, encode_chunk
from tandem_wire.pb import store_pb2, tensors_pb2

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 1 * MiB
MAX_MESSAGE_BYTES = 8 * MiB


def payload_chunks(tensors: Sequence[Tensor], chunk_bytes: int) -> Iterator[tuple[int, Any]]:
    """The concatenated tensor bytes as (offset, buffer) slices of chunk_bytes; slices
    inside one tensor are views (no copy), slices across tensors are joined."""
    offset, pending = 0, bytearray()
    for tensor in tensors:
        view = memoryview(tensor.data).cast("B")
        pos = 0
        while pos < len(view):
            if not pending and len(view) - pos >= chunk_bytes:
                yield offset, view[pos : pos + chunk_bytes]
                offset += chunk_bytes
                pos += chunk_bytes
                continue
            take = min(chunk_bytes - len(pending), len(view) - pos)
            pending += view[pos : pos + take]
            pos += take
            if len(pending) == chunk_bytes:
                yield offset, bytes(pending)
                offset += chunk_bytes
                pending = bytearray()
    if pending:
        yield offset, bytes(pending)


def bulk_methods(channel: Any) -> tuple[Any, Any, Any]:
    """Put and Get with hand-encoded chunks (see wire.py), on a sync or an aio channel."""
    put = channel.stream_unary(
        "/tandem.v1.Store/Put",
        request_serializer=_serialize,
        response_deserializer=store_pb2.PutResponse.FromString,
    )
    put_many = channel.stream_unary(
        "/tandem.v1.Store/PutMany",
        request_serializer=_serialize,
        response_deserializer=store_pb2.PutManyResponse.FromString,
    )
    get = channel.unary_stream(
        "/tandem.v1.Store/Get",
        request_serializer=store_pb2.GetRequest.SerializeToString,
        response_deserializer=_raw,
    )
    return put, get, put_many


@dataclass(frozen=True)
class RegionPut:
    """Where a Put's payload already lies: a registered region and each tensor's offset in
    it (attachments' tensors after the record's, in header order)."""

    region: str
    offsets: list[int]


def put_messages(
    checkpoint: Checkpoint,
    if_absent: bool,
    pin_ttl_s: int,
    pin_holder: str,
    chunk_bytes: int,
    placed: RegionPut | None = None,
) -> Iterator[store_pb2.PutRequest | bytes]:
    """A Put's stream: the header, then the payload as pre-encoded chunks; or the header
    alone, naming where the payload already lies in a region (placed)."""
    header = store_pb2.PutHeader(
        checkpoint=checkpoint.header_pb(),
        if_absent=if_absent,
        pin_ttl_seconds=pin_ttl_s,
        pin_holder=pin_holder,
    )
    if placed is not None:
        header.region = placed.region
        header.region_offsets.extend(placed.offsets)
        yield store_pb2.PutRequest(header=header)
        return
    yield store_pb2.PutRequest(header=header)
    for offset, data in payload_chunks(checkpoint.all_tensors(), chunk_bytes):
        yield encode_chunk(offset, data)


# A record whose payload is at most this travels inline in one PutRecords message (no stream
# to set up, read and wait on: per record about half the client's and the store's CPU of a
# streamed one, bench/store_bench.py); one call's inline payloads stay well under the store's
# message limit, its headers beside them.
INLINE_PAYLOAD_BYTES = 256 << 10
INLINE_CALL_BYTES = 4 * MiB
# The most one PutRecords message may be, headers included (long token-id lists add up): the
# store's limit less a margin.
ONE_MESSAGE_BYTES = 6 * MiB


def fits_one_message(items: Sequence[PutItem], placements: Sequence[RegionPut | None]) -> bool:
    """Whether these PutItems go in one PutRecords message (placements: where each payload
    lies in the region, or None); otherwise PutMany streams them."""
    inline = [i.checkpoint.payload_bytes for i, p in zip(items, placements, strict=True) if not p]
    return all(n <= INLINE_PAYLOAD_BYTES for n in inline) and sum(inline) <= INLINE_CALL_BYTES


def put_records_request(
    items: Sequence[PutItem], placements: Sequence[RegionPut | None]
) -> store_pb2.PutRecordsRequest | None:
    """The PutRecords message of PutItems whose payloads fit one (fits_one_message); None
    when their headers make it larger than ONE_MESSAGE_BYTES."""
    request = store_pb2.PutRecordsRequest()
    for item, placed in zip(items, placements, strict=True):
        record = request.records.add()
        header = record.header
        header.checkpoint.CopyFrom(item.checkpoint.header_pb())
        header.if_absent = item.if_absent
        header.pin_ttl_seconds = item.pin_ttl_s
        header.pin_holder = item.pin_holder
        if placed is not None:
            header.region = placed.region
            header.region_offsets.extend(placed.offsets)
        else:
            record.payload = b"".join(
                memoryview(t.data).cast("B") for t in item.checkpoint.all_tensors()
            )
    return request if request.ByteSize() <= ONE_MESSAGE_BYTES else None


def _serialize(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _raw(data: bytes) -> bytes:
    return data


def _alloc(nbytes: int) -> memoryview:
    """A writable buffer for a payload: an anonymous mapping, not a bytearray, which would
    be zero-filled first; its pages fault in as chunks are copied, overlapping the
    transfer (measured as fast as MAP_POPULATE, and it works on macOS too)."""
    return memoryview(mmap.mmap(-1, max(nbytes, 1)))[:nbytes]


class _TensorChecker:
    """Checks each tensor's CRC as its bytes arrive (while they are still in cache)."""

    def __init__(self, specs: Sequence[tensors_pb2.TensorSpec]) -> None:
        self._specs = [s for s in specs if s.nbytes]
        for spec in specs:
            if not spec.nbytes and spec.crc32:
                raise DataLoss(f"tensor {spec.name!r} failed its checksum after transfer")
        self._index = 0
        self._left = self._specs[0].nbytes if self._specs else 0
        self._crc = 0

    def feed(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            take = min(self._left, len(data) - pos)
            self._crc = crc32(data[pos : pos + take], self._crc)
            pos += take
            self._left -= take
            if self._left == 0:
                spec = self._specs[self._index]
                if self._crc != spec.crc32:
                    raise DataLoss(f"tensor {spec.name!r} failed its checksum after transfer")
                self._index += 1
                self._crc = 0
                self._left = (
                    self._specs[self._index].nbytes if self._index < len(self._specs) else 0
                )


class PayloadAssembler:
    """Builds a Checkpoint from a Get stream's raw messages (shared by the sync and asyncio
    clients): header first, then chunks copied into one buffer, CRCs checked as they land."""

    def __init__(self, first: bytes) -> None:
        header = store_pb2.GetResponse.FromString(first).header
        self.checkpoint = Checkpoint.from_header(header)
        self._specs = [*header.tensors, *(s for a in header.attachments for s in a.tensors)]
        self._view = _alloc(sum(s.nbytes for s in self._specs))
        self._checker = _TensorChecker(self._specs)
        self._received = 0

    def feed(self, raw: bytes) -> None:
        chunk = decode_chunk(raw)
        if chunk is None:
            parsed = store_pb2.GetResponse.FromString(raw).chunk
            chunk = parsed.offset, memoryview(parsed.data)
        offset, data = chunk
        received, view = self._received, self._view
        if offset != received or received + len(data) > len(view):
            raise DataLoss(f"store sent bytes at {offset}, expected {received}")
        target = view[received : received + len(data)]
        target[:] = data
        self._checker.feed(target)
        self._received += len(data)

    def finish(self) -> Checkpoint:
        if self._received != len(self._view):
            raise DataLoss(f"stream ended at {self._received} of {len(self._view)} bytes")
        offset = 0
        for tensor, spec in zip(self.checkpoint.all_tensors(), self._specs, strict=True):
            tensor.data = self._view[offset : offset + spec.nbytes]
            offset += spec.nbytes
        return self.checkpoint


def receive(stream: Iterator[bytes]) -> Checkpoint:
    messages = iter(stream)
    assembler = PayloadAssembler(next(messages))
    for raw in messages:
        assembler.feed(raw)
    return assembler.finish()
