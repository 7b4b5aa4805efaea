"""Records in the tier: chunks under a fresh nonce, then a manifest that names them, written
last, so a reader finds a whole record or none; every chunk checked against the manifest's
CRCs before a byte of it is used.

Keys (the namespace is inside `ikey`, the store's namespace tag + client key; the tier
never decides tenancy, it keeps the store's):

    tandem:m:<ikey hex>                     manifest: MAGIC, nonce, the StoredRecord encoding
    tandem:c:<ikey hex>:<nonce hex>:<i>     chunk i (one LMDB value's bytes)
    tandem:p:<scope+block hash hex>         ikey of a prefix record serving that block

No hash tags: a record's chunks spread over every slot, so a Get pulls from every primary.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from store_service.errors import Corrupt
from store_service.records import KIND_PREFIX, StoredRecord
from store_service.tier.cluster_client import ClusterClient
from tandem_wire.checksum import crc32

MAGIC = b"TQT1"
_NONCE = struct.Struct(">Q")
# Chunks fetched per round trip while a record is read: bounds the memory one read holds.
READ_WINDOW = 32


def manifest_key(ikey: bytes) -> bytes:
    return b"tandem:m:" + ikey.hex().encode()


def chunk_keys(ikey: bytes, nonce: int, count: int) -> list[bytes]:
    base = b"tandem:c:" + ikey.hex().encode() + b":" + b"%016x" % nonce + b":"
    return [base + str(i).encode() for i in range(count)]


def index_key(scope_and_hash: bytes) -> bytes:
    return b"tandem:p:" + scope_and_hash.hex().encode()


@dataclass(frozen=True)
class Manifest:
    nonce: int
    record: StoredRecord

    def encode(self) -> bytes:
        return MAGIC + _NONCE.pack(self.nonce) + self.record.encode()

    @classmethod
    def decode(cls, raw: bytes) -> Manifest:
        """Raises Corrupt for bytes that are not a whole manifest (its record has a CRC)."""
        if raw[: len(MAGIC)] != MAGIC or len(raw) < len(MAGIC) + _NONCE.size:
            raise Corrupt("a tier manifest without its magic")
        (nonce,) = _NONCE.unpack_from(raw, len(MAGIC))
        return cls(nonce, StoredRecord.decode(raw[len(MAGIC) + _NONCE.size :]))

    @property
    def chunk_keys(self) -> list[bytes]:
        return chunk_keys(self.record.ikey, self.nonce, len(self.record.chunk_crcs))


class TierRecords:
    """Write, find, read and delete whole records in the cluster."""

    def __init__(self, client: ClusterClient, ttl_s: int) -> None:
        self.client = client
        self.ttl_s = ttl_s

    def write(self, record: StoredRecord, chunks: Sequence[bytes], replicas: int = 0) -> int:
        """Stores a record whose payload is `chunks` (one per record slot): chunks first,
        then its prefix-index entries and manifest. Returns the bytes written.

        Raises:
            TierUnavailable: the cluster did not take it (nothing visible then).
        """
        manifest = Manifest(secrets.randbits(64), record)
        keys = manifest.chunk_keys
        try:
            replaced = self.manifest(record.ikey)
        except Corrupt:
            replaced = None
        if chunks:
            self.client.set_many(list(zip(keys, chunks, strict=True)), self.ttl_s, replicas)
        last = [(manifest_key(record.ikey), manifest.encode())]
        if record.header.kind == KIND_PREFIX:
            last += [(index_key(k), record.ikey) for k in record.index_keys()]
        self.client.set_many(last, self.ttl_s, replicas)
        if replaced is not None and replaced.chunk_keys:
            # The record it replaced: its chunks are nobody's now (a reader that took the old
            # manifest just before finds one missing: a miss, never mixed bytes).
            self.client.delete_many(replaced.chunk_keys)
        return sum(len(c) for c in chunks) + sum(len(v) for _, v in last)

    def manifest(self, ikey: bytes) -> Manifest | None:
        """The record stored under ikey, None if absent.

        Raises:
            Corrupt: its manifest is damaged. TierUnavailable.
        """
        (raw,) = self.client.get_many([manifest_key(ikey)])
        if raw is None:
            return None
        manifest = Manifest.decode(raw)
        if manifest.record.ikey != ikey:
            raise Corrupt("a tier manifest names another record")
        return manifest

    def read(self, manifest: Manifest) -> Iterator[bytes]:
        """The record's chunks in order, each checked against its CRC before it is yielded.

        Raises:
            Corrupt: a chunk is missing (expired, evicted, deleted) or fails its check.
            TierUnavailable.
        """
        record, keys = manifest.record, manifest.chunk_keys
        crc = 0
        for start in range(0, len(keys), READ_WINDOW):
            window = self.client.get_many(keys[start : start + READ_WINDOW])
            for i, value in enumerate(window, start):
                slot, expected = record.slots[i], record.chunk_crcs[i]
                if value is None:
                    raise Corrupt(f"tier chunk {i} of the record is missing")
                prev = 0 if slot.starts_tensor else crc
                if len(value) != slot.length or crc32(value, prev) != expected:
                    raise Corrupt(f"tier chunk {i} of the record failed its checksum")
                crc = expected
                yield value

    def find_prefix(self, scope: bytes, hashes: Sequence[bytes]) -> list[bytes]:
        """ikeys of prefix records indexed under the chain's block hashes, longest first."""
        if not hashes:
            return []
        values = self.client.get_many([index_key(scope + h) for h in reversed(hashes)])
        return [v for v in values if v is not None]

    def delete(self, ikey: bytes) -> bool:
        """Removes a record's manifest, chunks and index entries; False if there was none."""
        try:
            manifest = self.manifest(ikey)
        except Corrupt:
            self.client.delete_many([manifest_key(ikey)])
            return True
        if manifest is None:
            return False
        keys = [manifest_key(ikey), *manifest.chunk_keys]
        keys += [index_key(k) for k in manifest.record.index_keys()]
        self.client.delete_many(keys)
        return True
