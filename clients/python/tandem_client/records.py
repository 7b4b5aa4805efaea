"""The store's records as typed values: tensors, attachments, checkpoints, summaries, and their
protobuf forms. Shared by the sync and asyncio clients, the CLI and the engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem_wire.checksum import crc32
from tandem_wire.pb import store_pb2, tensors_pb2

Kind = Literal["prefix", "generation", "object"]
_KINDS: dict[str, int] = {
    "prefix": tensors_pb2.RECORD_KIND_PREFIX,
    "generation": tensors_pb2.RECORD_KIND_GENERATION,
    "object": tensors_pb2.RECORD_KIND_OBJECT,
}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}


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
        crc = crc32(view, 0) if self.crc32 is None else self.crc32
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

    @property
    def payload_bytes(self) -> int:
        """Its tensors' bytes, attachments' included: what a Put sends, a Get receives."""
        return sum(t.nbytes for t in self.all_tensors())

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
class PutItem:
    """One record of a put_many call, with its Put options."""

    checkpoint: Checkpoint
    if_absent: bool = False
    pin_ttl_s: int = 0
    pin_holder: str = ""


@dataclass(frozen=True)
class PutResult:
    key: bytes
    payload_bytes: int
    replaced: bool
    lease_id: str


@dataclass(frozen=True)
class HeaderRead:
    """One key of StoreClient.get_headers: its header (checkpoint without tensor bytes), or
    None when the namespace holds no such record; damaged: it is quarantined."""

    checkpoint: Checkpoint | None
    damaged: bool = False


@dataclass(frozen=True)
class LookupResult:
    found: bool
    key: bytes
    matched_tokens: int
    record_tokens: int
    trimmable: bool
    payload_bytes: int = 0  # what a Get into a region needs room for

    @classmethod
    def from_pb(cls, r: store_pb2.LookupResponse) -> LookupResult:
        return cls(r.found, r.key, r.matched_tokens, r.record_tokens, r.trimmable, r.payload_bytes)


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


def record_filter(
    namespace: str, model_id: str, kind: str, older_than_s: int, idle_for_s: int
) -> store_pb2.RecordFilter:
    return store_pb2.RecordFilter(
        namespace=namespace,
        model_id=model_id,
        kind=kind_to_pb(kind),
        older_than_seconds=older_than_s,
        idle_for_seconds=idle_for_s,
    )
