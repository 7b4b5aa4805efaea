"""Record types: the on-disk formats (records, leases), summaries, and their from_pb/to_pb
(the validated Put header is put_spec.py).

Keys in LMDB are fixed-width where it matters:
- a record's key is `namespace tag (8 bytes) + client key`, so tenants can never
  read or overwrite each other's records, even with a guessed key;
- a chunk's key is `record id (8 bytes, big-endian) + chunk index (4 bytes)`, so a
  record's chunks are contiguous and a replaced record's chunks never collide.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from google.protobuf.message import DecodeError

from store_service.errors import Corrupt, InvalidRequest
from tandem_wire.limits import (
    MAX_KEY_BYTES,
    label_problem,
    layout_problem,
    namespace_problem,
)
from tandem_wire.pb import store_pb2, tensors_pb2

DEFAULT_NAMESPACE = "default"
NS_TAG_BYTES = 8
RecordKind = int  # tensors_pb2.RecordKind values
KIND_PREFIX: RecordKind = tensors_pb2.RECORD_KIND_PREFIX


def normalize_namespace(namespace: str) -> str:
    problem = namespace_problem(namespace)
    if problem:
        raise InvalidRequest(problem)
    return namespace or DEFAULT_NAMESPACE


def check_label(field: str, value: str) -> str:
    """A short free-text field (holder, lease id, model id...), returned if within
    MAX_LABEL_CHARS. Raises InvalidRequest."""
    problem = label_problem(field, value)
    if problem:
        raise InvalidRequest(problem)
    return value


def check_layout(field: str, layout: Sequence[str]) -> None:
    """Raises InvalidRequest for a layout signature past its limits."""
    problem = layout_problem(field, list(layout))
    if problem:
        raise InvalidRequest(problem)


def record_key(namespace: str, key: bytes) -> bytes:
    """The LMDB key of a record: namespace tag + client key."""
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise InvalidRequest(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    tag = hashlib.blake2b(namespace.encode(), digest_size=NS_TAG_BYTES).digest()
    return tag + key


def chunk_key(record_id: int, index: int) -> bytes:
    return struct.pack(">QI", record_id, index)


def record_id_prefix(record_id: int) -> bytes:
    return struct.pack(">Q", record_id)


def prefix_scope(namespace: str, model_id: str, layout: list[str], block_size: int) -> bytes:
    """Digest of everything two records must share for one to serve the other's prefix."""
    text = "\0".join([namespace, model_id, "|".join(layout), str(block_size)])
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def all_tensors(header: tensors_pb2.CheckpointHeader) -> list[tensors_pb2.TensorSpec]:
    """Tensors in payload order: the checkpoint's, then each attachment's."""
    specs = list(header.tensors)
    for attachment in header.attachments:
        specs.extend(attachment.tensors)
    return specs


@dataclass(frozen=True)
class ChunkSlot:
    """Where one stored chunk sits: which tensor, and its span in the payload."""

    index: int
    tensor: int
    offset: int
    length: int
    starts_tensor: bool


def chunk_layout(sizes: list[int], chunk_bytes: int) -> list[ChunkSlot]:
    """Splits each tensor into stored chunks; a chunk never spans two tensors, so its
    stored CRC can be the tensor's running CRC (one checksum pass on put and on get)."""
    return list(_layout(tuple(sizes), chunk_bytes))


@lru_cache(maxsize=256)
def _layout(sizes: tuple[int, ...], chunk_bytes: int) -> tuple[ChunkSlot, ...]:
    """Remembered: records of one model and length share their shapes, and a large one's
    layout costs milliseconds to build for every Get."""
    slots: list[ChunkSlot] = []
    offset = 0
    for tensor, size in enumerate(sizes):
        for start in range(0, size, chunk_bytes):
            length = min(chunk_bytes, size - start)
            slots.append(ChunkSlot(len(slots), tensor, offset + start, length, start == 0))
        offset += size
    return tuple(slots)


def chain_lengths(block_size: int, token_count: int, count: int) -> list[int]:
    """Token length covered by each entry of a block-hash chain."""
    return [min((i + 1) * block_size, token_count) for i in range(count)]


_META = struct.Struct(">BBQqQII")  # version, flags, record id, created ms, bytes, chunk, n
# 2: the value ends with a CRC-32 of everything before it. 1 (before 2026-12-01): no
# checksum; such records are read once at start-up and rewritten as 2 (recovery.py).
_FORMAT_VERSION = 2
_LEGACY_VERSION = 1
_CRC = struct.Struct(">I")
_QUARANTINED = 1


def _undecodable(what: str, exc: Exception) -> Corrupt:
    return Corrupt(f"{what} cannot be decoded ({type(exc).__name__}: {exc})")


@dataclass
class StoredRecord:
    """A record's header as kept in the `headers` (or `quarantine`) table."""

    record_id: int
    created_ms: int
    payload_bytes: int
    chunk_bytes: int
    chunk_crcs: list[int]
    header: tensors_pb2.CheckpointHeader
    quarantined: bool = False
    last_access_ms: int = 0
    # Read from format 1 (no header checksum): recovery rewrites it in the current format.
    legacy: bool = field(default=False, compare=False)

    def encode(self) -> bytes:
        flags = _QUARANTINED if self.quarantined else 0
        head = _META.pack(
            _FORMAT_VERSION,
            flags,
            self.record_id,
            self.created_ms,
            self.payload_bytes,
            self.chunk_bytes,
            len(self.chunk_crcs),
        )
        crcs = struct.pack(f">{len(self.chunk_crcs)}I", *self.chunk_crcs)
        body = head + crcs + self.header.SerializeToString()
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def decode(cls, raw: bytes) -> StoredRecord:
        """Raises Corrupt when the value fails its checksum or does not parse."""
        raw = bytes(raw)
        if not raw:
            raise Corrupt("record header is empty")
        version = raw[0]
        if version == _FORMAT_VERSION:
            if len(raw) < _META.size + _CRC.size:
                raise Corrupt("record header is truncated")
            body = raw[: -_CRC.size]
            if zlib.crc32(body) != _CRC.unpack_from(raw, len(body))[0]:
                raise Corrupt("record header failed its checksum")
        elif version == _LEGACY_VERSION:
            body = raw
        else:
            raise Corrupt(f"record header has unknown format {version}")
        try:
            _, flags, record_id, created, nbytes, chunk, n = _META.unpack_from(body)
            start = _META.size
            crcs = list(struct.unpack_from(f">{n}I", body, start))
            header = tensors_pb2.CheckpointHeader.FromString(body[start + 4 * n :])
        except (struct.error, DecodeError, ValueError) as exc:
            raise _undecodable("record header", exc) from exc
        record = cls(
            record_id, created, nbytes, chunk, crcs, header, bool(flags & _QUARANTINED), created
        )
        record.legacy = version == _LEGACY_VERSION
        return record

    @cached_property
    def slots(self) -> list[ChunkSlot]:
        return chunk_layout([s.nbytes for s in all_tensors(self.header)], self.chunk_bytes)

    @property
    def ikey(self) -> bytes:
        return record_key(self.header.namespace, self.header.key)

    def index_keys(self) -> list[bytes]:
        """Prefix-index entries: every block boundary if trimmable, else the exact length."""
        h = self.header
        if not h.block_hashes or h.kind != KIND_PREFIX:
            return []
        scope = prefix_scope(h.namespace, h.model_id, list(h.layout), h.block_size)
        hashes = list(h.block_hashes) if h.trimmable else [h.block_hashes[-1]]
        return [scope + bytes(x) for x in hashes]


_LEASE = struct.Struct(">qB")  # expires ms, key length; then the key and the holder
_LEASE_MARK = b"\xff"  # then a CRC-32 of the rest


@dataclass(frozen=True)
class Lease:
    """A lease protecting a record from eviction, as kept in the `leases` table."""

    lease_id: str
    ikey: bytes
    holder: str
    expires_ms: int

    def encode(self) -> bytes:
        body = _LEASE.pack(self.expires_ms, len(self.ikey)) + self.ikey + self.holder.encode()
        return _LEASE_MARK + _CRC.pack(zlib.crc32(body)) + body

    @classmethod
    def decode(cls, lease_id: bytes, raw: bytes) -> Lease:
        """Raises Corrupt when the value fails its checksum or does not parse. Leases written
        before checksums (no mark: their first byte is the expiry's, never 0xFF) are read
        as they are."""
        raw = bytes(raw)
        if raw[:1] == _LEASE_MARK:
            body = raw[1 + _CRC.size :]
            if len(raw) < 1 + _CRC.size or zlib.crc32(body) != _CRC.unpack_from(raw, 1)[0]:
                raise Corrupt(f"lease {lease_id!r} failed its checksum")
        else:
            body = raw
        try:
            expires, klen = _LEASE.unpack_from(body)
            start = _LEASE.size
            ikey = body[start : start + klen]
            return cls(lease_id.decode(), ikey, body[start + klen :].decode(), expires)
        except (struct.error, UnicodeDecodeError) as exc:
            raise _undecodable(f"lease {lease_id!r}", exc) from exc

    def to_pb(self) -> store_pb2.Lease:
        return store_pb2.Lease(
            lease_id=self.lease_id, holder=self.holder, expires_at_unix_ms=self.expires_ms
        )


@dataclass
class RecordInfo:
    """What the in-memory index keeps per record (no tensor descriptions)."""

    ikey: bytes
    namespace: str
    key: bytes
    kind: int
    model_id: str
    token_count: int
    payload_bytes: int
    tensor_count: int
    attachment_count: int
    created_ms: int
    last_access_ms: int
    trimmable: bool
    quarantined: bool = False
    pinned: bool = field(default=False, compare=False)
    # The prefix-index entries its (checksummed) header implies: an entry read from the
    # index table is served only if its record agrees (store.lookup).
    index_keys: frozenset[bytes] = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def of(cls, record: StoredRecord) -> RecordInfo:
        h = record.header
        return cls(
            ikey=record.ikey,
            namespace=h.namespace,
            key=bytes(h.key),
            kind=h.kind,
            model_id=h.model_id,
            token_count=h.token_count,
            payload_bytes=0 if record.quarantined else record.payload_bytes,
            tensor_count=len(h.tensors),
            attachment_count=len(h.attachments),
            created_ms=record.created_ms,
            last_access_ms=record.last_access_ms,
            trimmable=h.trimmable,
            quarantined=record.quarantined,
            index_keys=frozenset(record.index_keys()),
        )

    def to_pb(self) -> store_pb2.RecordSummary:
        return store_pb2.RecordSummary(
            namespace=self.namespace,
            key=self.key,
            kind=tensors_pb2.RecordKind.ValueType(self.kind),
            model_id=self.model_id,
            token_count=self.token_count,
            payload_bytes=self.payload_bytes,
            tensor_count=self.tensor_count,
            attachment_count=self.attachment_count,
            created_at_unix_ms=self.created_ms,
            last_access_unix_ms=self.last_access_ms,
            pinned=self.pinned,
            trimmable=self.trimmable,
            quarantined=self.quarantined,
        )


@dataclass(frozen=True)
class RecordFilter:
    namespace: str = ""
    model_id: str = ""
    kind: int = 0
    older_than_s: int = 0
    idle_for_s: int = 0
    # The namespaces the caller may see (auth); None = all.
    allowed: Callable[[str], bool] | None = None

    @classmethod
    def from_pb(cls, f: store_pb2.RecordFilter) -> RecordFilter:
        model_id = check_label("filter.model_id", f.model_id)
        return cls(f.namespace, model_id, f.kind, f.older_than_seconds, f.idle_for_seconds)

    def matches(self, info: RecordInfo, now: int) -> bool:
        return (
            (not self.namespace or info.namespace == self.namespace)
            and (self.allowed is None or self.allowed(info.namespace))
            and (not self.model_id or info.model_id == self.model_id)
            and (not self.kind or info.kind == self.kind)
            and now - info.created_ms >= self.older_than_s * 1000
            and now - info.last_access_ms >= self.idle_for_s * 1000
        )
