"""A Put's header, validated: key, kind, labels, metadata size, block chain and tensor sizes
checked before a byte of payload is accepted."""

from __future__ import annotations

import math
from dataclasses import dataclass

from store_service.errors import InvalidRequest
from store_service.records import (
    all_tensors,
    check_label,
    check_layout,
    normalize_namespace,
    record_key,
)
from tandem_wire.limits import DTYPE_BYTES, MAX_METADATA_BYTES
from tandem_wire.pb import store_pb2, tensors_pb2


@dataclass
class PutSpec:
    """A validated Put header."""

    namespace: str
    key: bytes
    ikey: bytes
    header: tensors_pb2.CheckpointHeader
    if_absent: bool
    pin_ttl_s: int
    pin_holder: str
    sizes: list[int]

    @property
    def payload_bytes(self) -> int:
        return sum(self.sizes)

    @classmethod
    def from_pb(cls, put: store_pb2.PutHeader) -> PutSpec:
        return cls.validated(
            put.checkpoint,
            if_absent=put.if_absent,
            pin_ttl_s=put.pin_ttl_seconds,
            pin_holder=put.pin_holder,
        )

    @classmethod
    def validated(
        cls,
        checkpoint: tensors_pb2.CheckpointHeader,
        *,
        if_absent: bool = False,
        pin_ttl_s: int = 0,
        pin_holder: str = "",
    ) -> PutSpec:
        """Checks a checkpoint header (key, kind, tensor sizes, block chain) and copies it.

        Raises:
            InvalidRequest: the header is malformed.
        """
        header = tensors_pb2.CheckpointHeader()
        header.CopyFrom(checkpoint)
        header.namespace = normalize_namespace(header.namespace)
        ikey = record_key(header.namespace, header.key)
        if header.kind == tensors_pb2.RECORD_KIND_UNSPECIFIED:
            raise InvalidRequest("header.kind is required")
        if header.kind not in tensors_pb2.RecordKind.values():
            raise InvalidRequest(f"header.kind {header.kind} is not a RecordKind")
        if header.token_ids and min(header.token_ids) < 0:
            raise InvalidRequest("header.token_ids must be >= 0")
        check_label("pin_holder", pin_holder)
        check_label("header.model_id", header.model_id)
        check_layout("header.layout", header.layout)
        for attachment in header.attachments:
            check_label("an attachment's schema", attachment.schema)
        metadata = [header.metadata, *(a.metadata for a in header.attachments)]
        size = sum(len(k.encode()) + len(v.encode()) for m in metadata for k, v in m.items())
        if size > MAX_METADATA_BYTES:
            raise InvalidRequest(
                f"header.metadata is {size} bytes; the limit is {MAX_METADATA_BYTES}"
            )
        if header.token_ids:
            if header.token_count not in (0, len(header.token_ids)):
                raise InvalidRequest("token_count disagrees with token_ids")
            header.token_count = len(header.token_ids)
        _check_block_chain(header.block_size, list(header.block_hashes), header.token_count)
        specs = all_tensors(header)
        names: set[str] = set()
        for spec in specs:
            _check_tensor(spec)
            names.add(spec.name)
        if len(names) != len(header.tensors) + sum(len(a.tensors) for a in header.attachments):
            raise InvalidRequest("tensor names must be unique within a checkpoint")
        return cls(
            namespace=header.namespace,
            key=bytes(header.key),
            ikey=ikey,
            header=header,
            if_absent=if_absent,
            pin_ttl_s=pin_ttl_s,
            pin_holder=pin_holder,
            sizes=[spec.nbytes for spec in specs],
        )


def _check_tensor(spec: tensors_pb2.TensorSpec) -> None:
    if not spec.name:
        raise InvalidRequest("every tensor needs a name")
    check_label("a tensor name", spec.name)
    if any(dim < 0 for dim in spec.shape):
        raise InvalidRequest(f"tensor {spec.name!r} has a negative dimension")
    width = DTYPE_BYTES.get(spec.dtype)
    if width is None:
        raise InvalidRequest(
            f"tensor {spec.name!r}: dtype {spec.dtype[:32]!r} is not one of {sorted(DTYPE_BYTES)}"
        )
    if math.prod(spec.shape) * width != spec.nbytes:
        raise InvalidRequest(
            f"tensor {spec.name!r}: {spec.dtype}{list(spec.shape)} is "
            f"{math.prod(spec.shape) * width} bytes, header says {spec.nbytes}"
        )


def _check_block_chain(block_size: int, hashes: list[bytes], token_count: int) -> None:
    if not hashes:
        return
    if block_size <= 0:
        raise InvalidRequest("block_hashes need a positive block_size")
    if len(hashes) != math.ceil(token_count / block_size):
        raise InvalidRequest(
            f"{len(hashes)} block hashes for {token_count} tokens of block size {block_size}"
        )
    if any(not 8 <= len(h) <= 64 for h in hashes):
        raise InvalidRequest("block hashes must be 8..64 bytes")
