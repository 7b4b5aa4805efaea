"""StoreClient: put, get and look up checkpoints, and administer the store, with typed results."""

from __future__ import annotations

import builtins
import mmap
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import grpc

from tandem_client.channel import GrpcClient
from tandem_client.errors import DataLoss
from tandem_wire.chunks import decode_chunk, encode_chunk
from tandem_wire.pb import store_pb2, store_pb2_grpc, tensors_pb2

Kind = Literal["prefix", "generation", "object"]
_KINDS: dict[str, int] = {
    "prefix": tensors_pb2.RECORD_KIND_PREFIX,
    "generation": tensors_pb2.RECORD_KIND_GENERATION,
    "object": tensors_pb2.RECORD_KIND_OBJECT,
}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 1 * MiB
MAX_MESSAGE_BYTES = 8 * MiB
T = TypeVar("T")


def kind_to_pb(kind: str) -> tensors_pb2.RecordKind.ValueType:
    if not kind:
        return tensors_pb2.RECORD_KIND_UNSPECIFIED
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {sorted(_KINDS)}, got {kind!r}")
    return tensors_pb2.RecordKind.ValueType(_KINDS[kind])


def kind_name(value: int) -> str:
    return _KIND_NAMES.get(value, "unspecified")


@dataclass
class Tensor:
    """A named tensor as bytes; `data` is any buffer (bytes, memoryview, numpy array...)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Any = b""
    crc32: int | None = None
    # From a header without its bytes (Inspect, List): the stored size.
    stored_nbytes: int | None = None

    @property
    def nbytes(self) -> int:
        size = memoryview(self.data).nbytes
        return self.stored_nbytes if size == 0 and self.stored_nbytes is not None else size

    def to_pb(self) -> tensors_pb2.TensorSpec:
        view = memoryview(self.data).cast("B")
        crc = zlib.crc32(view) if self.crc32 is None else self.crc32
        return tensors_pb2.TensorSpec(
            name=self.name, dtype=self.dtype, shape=list(self.shape), nbytes=view.nbytes, crc32=crc
        )


@dataclass
class Attachment:
    schema: str
    tensors: list[Tensor] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class Checkpoint:
    key: bytes
    kind: str = "prefix"
    namespace: str = ""
    model_id: str = ""
    layout: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_count: int = 0
    tensors: list[Tensor] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    attachments: list[Attachment] = field(default_factory=list)
    trimmable: bool = True
    block_size: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def all_tensors(self) -> list[Tensor]:
        return [*self.tensors, *(t for a in self.attachments for t in a.tensors)]

    def header_pb(self) -> tensors_pb2.CheckpointHeader:
        return tensors_pb2.CheckpointHeader(
            key=self.key,
            kind=kind_to_pb(self.kind),
            namespace=self.namespace,
            model_id=self.model_id,
            layout=self.layout,
            token_ids=self.token_ids,
            token_count=self.token_count or len(self.token_ids),
            tensors=[t.to_pb() for t in self.tensors],
            metadata=self.metadata,
            attachments=[
                tensors_pb2.Attachment(
                    schema=a.schema, metadata=a.metadata, tensors=[t.to_pb() for t in a.tensors]
                )
                for a in self.attachments
            ],
            trimmable=self.trimmable,
            block_size=self.block_size,
            block_hashes=self.block_hashes,
        )

    @classmethod
    def from_header(cls, h: tensors_pb2.CheckpointHeader) -> Checkpoint:
        def tensor(s: tensors_pb2.TensorSpec) -> Tensor:
            return Tensor(s.name, s.dtype, tuple(s.shape), b"", s.crc32, s.nbytes)

        return cls(
            key=h.key,
            kind=kind_name(h.kind),
            namespace=h.namespace,
            model_id=h.model_id,
            layout=list(h.layout),
            token_ids=list(h.token_ids),
            token_count=h.token_count,
            tensors=[tensor(s) for s in h.tensors],
            metadata=dict(h.metadata),
            attachments=[
                Attachment(a.schema, [tensor(s) for s in a.tensors], dict(a.metadata))
                for a in h.attachments
            ],
            trimmable=h.trimmable,
            block_size=h.block_size,
            block_hashes=list(h.block_hashes),
        )


@dataclass(frozen=True)
class PutResult:
    key: bytes
    payload_bytes: int
    replaced: bool
    lease_id: str


@dataclass(frozen=True)
class LookupResult:
    found: bool
    key: bytes
    matched_tokens: int
    record_tokens: int
    trimmable: bool

    @classmethod
    def from_pb(cls, r: store_pb2.LookupResponse) -> LookupResult:
        return cls(r.found, r.key, r.matched_tokens, r.record_tokens, r.trimmable)


def lookup_request(
    namespace: str,
    model_id: str,
    layout: Sequence[str],
    block_size: int,
    block_hashes: Sequence[bytes],
    token_count: int,
    kind: str,
) -> store_pb2.LookupRequest:
    return store_pb2.LookupRequest(
        namespace=namespace,
        model_id=model_id,
        layout=list(layout),
        block_size=block_size,
        block_hashes=list(block_hashes),
        token_count=token_count,
        kind=kind_to_pb(kind),
    )


@dataclass(frozen=True)
class Lease:
    lease_id: str
    holder: str
    expires_at_unix_ms: int


@dataclass(frozen=True)
class RecordSummary:
    namespace: str
    key: bytes
    kind: str
    model_id: str
    token_count: int
    payload_bytes: int
    tensor_count: int
    attachment_count: int
    created_at_unix_ms: int
    last_access_unix_ms: int
    pinned: bool
    trimmable: bool
    quarantined: bool

    @classmethod
    def from_pb(cls, s: store_pb2.RecordSummary) -> RecordSummary:
        return cls(
            s.namespace,
            s.key,
            kind_name(s.kind),
            s.model_id,
            s.token_count,
            s.payload_bytes,
            s.tensor_count,
            s.attachment_count,
            s.created_at_unix_ms,
            s.last_access_unix_ms,
            s.pinned,
            s.trimmable,
            s.quarantined,
        )


@dataclass(frozen=True)
class Inspection:
    summary: RecordSummary
    checkpoint: Checkpoint
    leases: list[Lease]
    chunk_count: int
    chunk_bytes: int


def _filter(
    namespace: str, model_id: str, kind: str, older_than_s: int, idle_for_s: int
) -> store_pb2.RecordFilter:
    return store_pb2.RecordFilter(
        namespace=namespace,
        model_id=model_id,
        kind=kind_to_pb(kind),
        older_than_seconds=older_than_s,
        idle_for_seconds=idle_for_s,
    )


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


class StoreClient(GrpcClient):
    """Synchronous client of `tandem.v1.Store` and `tandem.v1.StoreAdmin`."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = 60.0,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        super().__init__(address, timeout, credentials, options)
        self._store = store_pb2_grpc.StoreStub(self._channel)
        # Bulk paths with hand-encoded chunks (see wire.py).
        self._put, self._get = bulk_methods(self._channel)
        self._admin = store_pb2_grpc.StoreAdminStub(self._channel)

    # -- data plane --------------------------------------------------------------------------

    def put(
        self,
        checkpoint: Checkpoint,
        *,
        if_absent: bool = False,
        pin_ttl_s: int = 0,
        pin_holder: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> PutResult:
        requests = put_messages(checkpoint, if_absent, pin_ttl_s, pin_holder, chunk_bytes)
        r: store_pb2.PutResponse = self._call(lambda: self._put(requests, timeout=self.timeout))
        return PutResult(r.key, r.payload_bytes, r.replaced, r.lease_id)

    def get(self, key: bytes, namespace: str = "", *, max_chunk_bytes: int = 0) -> Checkpoint:
        """The checkpoint with its tensors' bytes, each tensor's CRC checked end to end."""
        stream = self._get(
            store_pb2.GetRequest(namespace=namespace, key=key, max_chunk_bytes=max_chunk_bytes),
            timeout=self.timeout,
        )
        return self._call(lambda: _receive(stream))

    def get_header(self, key: bytes, namespace: str = "") -> Checkpoint:
        stream = self._store.Get(
            store_pb2.GetRequest(namespace=namespace, key=key, header_only=True),
            timeout=self.timeout,
        )
        return self._call(lambda: Checkpoint.from_header(next(iter(stream)).header))

    def lookup(
        self,
        *,
        namespace: str,
        model_id: str,
        layout: Sequence[str],
        block_size: int,
        block_hashes: Sequence[bytes],
        token_count: int,
        kind: str = "",
    ) -> LookupResult:
        request = lookup_request(
            namespace, model_id, layout, block_size, block_hashes, token_count, kind
        )
        r = self._call(lambda: self._store.Lookup(request, timeout=self.timeout))
        return LookupResult.from_pb(r)

    def pin(
        self,
        key: bytes,
        namespace: str = "",
        *,
        ttl_s: int = 0,
        holder: str = "",
        lease_id: str = "",
    ) -> Lease:
        r = self._call(
            lambda: self._store.Pin(
                store_pb2.PinRequest(
                    namespace=namespace,
                    key=key,
                    ttl_seconds=ttl_s,
                    holder=holder,
                    lease_id=lease_id,
                ),
                timeout=self.timeout,
            )
        )
        return Lease(r.lease_id, holder, r.expires_at_unix_ms)

    def unpin(self, key: bytes, lease_id: str, namespace: str = "") -> None:
        self._call(
            lambda: self._store.Unpin(
                store_pb2.UnpinRequest(namespace=namespace, key=key, lease_id=lease_id),
                timeout=self.timeout,
            )
        )

    # -- admin -------------------------------------------------------------------------------

    def list(
        self,
        *,
        namespace: str = "",
        model_id: str = "",
        kind: str = "",
        older_than_s: int = 0,
        idle_for_s: int = 0,
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[builtins.list[RecordSummary], str]:
        r = self._call(
            lambda: self._admin.List(
                store_pb2.ListRequest(
                    filter=_filter(namespace, model_id, kind, older_than_s, idle_for_s),
                    page_size=page_size,
                    page_token=page_token,
                ),
                timeout=self.timeout,
            )
        )
        return [RecordSummary.from_pb(s) for s in r.records], r.next_page_token

    def list_all(self, **filters: Any) -> builtins.list[RecordSummary]:
        records, token = self.list(**filters)
        while token:
            more, token = self.list(page_token=token, **filters)
            records.extend(more)
        return records

    def inspect(self, key: bytes, namespace: str = "") -> Inspection:
        r = self._call(
            lambda: self._admin.Inspect(
                store_pb2.InspectRequest(namespace=namespace, key=key), timeout=self.timeout
            )
        )
        return Inspection(
            RecordSummary.from_pb(r.summary),
            Checkpoint.from_header(r.header),
            [Lease(x.lease_id, x.holder, x.expires_at_unix_ms) for x in r.leases],
            r.chunk_count,
            r.chunk_bytes,
        )

    def delete(self, key: bytes, namespace: str = "", *, force: bool = False) -> int:
        r: store_pb2.DeleteResponse = self._call(
            lambda: self._admin.Delete(
                store_pb2.DeleteRequest(namespace=namespace, key=key, force=force),
                timeout=self.timeout,
            )
        )
        return r.freed_bytes

    def purge(
        self,
        *,
        namespace: str = "",
        model_id: str = "",
        kind: str = "",
        older_than_s: int = 0,
        idle_for_s: int = 0,
        include_pinned: bool = False,
        dry_run: bool = False,
    ) -> builtins.list[RecordSummary]:
        r = self._call(
            lambda: self._admin.Purge(
                store_pb2.PurgeRequest(
                    filter=_filter(namespace, model_id, kind, older_than_s, idle_for_s),
                    include_pinned=include_pinned,
                    dry_run=dry_run,
                ),
                timeout=self.timeout,
            )
        )
        return [RecordSummary.from_pb(s) for s in r.removed]

    def stats(self) -> store_pb2.StatsResponse:
        r: store_pb2.StatsResponse = self._call(
            lambda: self._admin.Stats(store_pb2.StatsRequest(), timeout=self.timeout)
        )
        return r

    def flush(self) -> bool:
        """The store's durability barrier: True once everything acknowledged is on disk."""
        r: store_pb2.FlushResponse = self._call(
            lambda: self._admin.Flush(store_pb2.FlushRequest(), timeout=self.timeout)
        )
        return r.durable

    def compact(self) -> tuple[int, int]:
        r = self._call(lambda: self._admin.Compact(store_pb2.CompactRequest(), timeout=None))
        return r.file_bytes_before, r.file_bytes_after


def bulk_methods(channel: Any) -> tuple[Any, Any]:
    """Put and Get with hand-encoded chunks (see wire.py), on a sync or an aio channel."""
    put = channel.stream_unary(
        "/tandem.v1.Store/Put",
        request_serializer=_serialize,
        response_deserializer=store_pb2.PutResponse.FromString,
    )
    get = channel.unary_stream(
        "/tandem.v1.Store/Get",
        request_serializer=store_pb2.GetRequest.SerializeToString,
        response_deserializer=_raw,
    )
    return put, get


def put_messages(
    checkpoint: Checkpoint, if_absent: bool, pin_ttl_s: int, pin_holder: str, chunk_bytes: int
) -> Iterator[store_pb2.PutRequest | bytes]:
    """A Put's stream: the header, then the payload as pre-encoded chunks."""
    yield store_pb2.PutRequest(
        header=store_pb2.PutHeader(
            checkpoint=checkpoint.header_pb(),
            if_absent=if_absent,
            pin_ttl_seconds=pin_ttl_s,
            pin_holder=pin_holder,
        )
    )
    for offset, data in payload_chunks(checkpoint.all_tensors(), chunk_bytes):
        yield encode_chunk(offset, data)


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
            self._crc = zlib.crc32(data[pos : pos + take], self._crc)
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


def _receive(stream: Iterator[bytes]) -> Checkpoint:
    messages = iter(stream)
    assembler = PayloadAssembler(next(messages))
    for raw in messages:
        assembler.feed(raw)
    return assembler.finish()
