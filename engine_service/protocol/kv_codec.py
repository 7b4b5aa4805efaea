"""How a request's full-attention KV rows are stored (plain; affine-quantized to 4/8 bits, or
TurboQuant-coded at 2-4 bits, from some length on), and what that does to the request's cache
layout signature (DESIGN.md).

Pure data and rules, no MLX: the wire layer validates requests against it, the batch cache
(kv/batch_cache.py) stores rows by it, checkpoints key and check layouts with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
TURBOQUANT_BITS = (2, 3, 4)


class Scheme(Enum):
    """How a quantized row codes its vectors."""

    AFFINE = "quant"  # mlx-lm's mx.quantize: per-group scale and bias
    TURBOQUANT = "turboquant"  # kv/turboquant.py: a rotation, then a Gaussian codebook


class StorageKind(Enum):
    PLAIN = "plain"
    AFFINE = "affine"
    TURBOQUANT = "turboquant"


@dataclass(frozen=True)
class Storage:
    """The format one group of batch rows is stored in (kv/planes.py): rows of equal storage
    share planes."""

    kind: StorageKind
    bits: int = 0  # affine bits, or TurboQuant's key bits
    group_size: int = 0  # affine only
    value_bits: int = 0  # TurboQuant only

    @property
    def packed(self) -> bool:
        return self.kind is not StorageKind.PLAIN

    def to_json(self) -> list[Any]:
        return [self.kind.value, self.bits, self.group_size, self.value_bits]

    @classmethod
    def from_json(cls, v: list[Any]) -> Storage:
        return cls(StorageKind(v[0]), int(v[1]), int(v[2]), int(v[3]))


PLAIN = Storage(StorageKind.PLAIN)


@dataclass(frozen=True)
class KVCodec:
    """How a request's full-attention KV rows are stored: plain, or quantized once the row
    holds `start` tokens (affine at `bits` per `group_size`, or TurboQuant at `bits` for keys
    and `value_bits` for values)."""

    bits: int = 0  # 0: plain (the model's dtype)
    group_size: int = 64
    start: int = 0
    scheme: Scheme = Scheme.AFFINE
    value_bits: int = 0  # TurboQuant only

    @classmethod
    def turboquant(cls, key_bits: int, value_bits: int, start: int = 0) -> KVCodec:
        return cls(key_bits, 64, start, Scheme.TURBOQUANT, value_bits)

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    @property
    def storage(self) -> Storage:
        """The storage of the row once converted (PLAIN for a plain codec)."""
        if not self.bits:
            return PLAIN
        if self.scheme is Scheme.TURBOQUANT:
            return Storage(StorageKind.TURBOQUANT, self.bits, 0, self.value_bits)
        return Storage(StorageKind.AFFINE, self.bits, self.group_size)

    def signature(self) -> str:
        """The layout codec id of a plain KV layer under this codec (DESIGN.md)."""
        base = storage_signature(self.storage)
        return f"{base}:from{self.start}" if self.bits and self.start else base

    def accepts(self, stored: str) -> bool:
        """Whether a layer captured as `stored` belongs to a row of this codec: a quantized
        row is plain until it converts."""
        return stored in ("kv:plain", storage_signature(self.storage))

    def to_json(self) -> list[Any]:
        return [self.bits, self.group_size, self.start, self.scheme.value, self.value_bits]

    @classmethod
    def from_json(cls, v: list[Any]) -> KVCodec:
        return cls(int(v[0]), int(v[1]), int(v[2]), Scheme(v[3]), int(v[4]))


PLAIN_KV = KVCodec()


def checked_codec(
    bits: int, group_size: int, start: int, scheme: Scheme, value_bits: int = 0
) -> KVCodec:
    """A codec from a request's or the engine's settings; ValueError names what is wrong.
    value_bits 0: as many as the keys (TurboQuant)."""
    if scheme is Scheme.TURBOQUANT:
        if bits not in (0, *TURBOQUANT_BITS):
            raise ValueError(f"kv_bits must be 0 (plain), 2, 3 or 4 for TurboQuant, got {bits}")
        value_bits = value_bits or bits
        if bits and value_bits not in TURBOQUANT_BITS:
            raise ValueError(f"kv_value_bits must be 2, 3 or 4, got {value_bits}")
    else:
        if bits not in (0, *BITS):
            raise ValueError(f"kv_bits must be 0 (plain), 4 or 8, got {bits}")
        if value_bits:
            raise ValueError("kv_value_bits is TurboQuant's (kv_scheme turboquant)")
        if group_size not in GROUP_SIZES:
            raise ValueError(f"kv_group_size must be 32, 64 or 128, got {group_size}")
    if start < 0:
        raise ValueError(f"quantized_kv_start must be >= 0, got {start}")
    if not bits:
        return PLAIN_KV
    if scheme is Scheme.TURBOQUANT:
        return KVCodec.turboquant(bits, value_bits, start)
    return KVCodec(bits, group_size, start)


def storage_signature(storage: Storage) -> str:
    """The layout codec id of a layer stored as `storage` (no start: a captured layer)."""
    if storage.kind is StorageKind.TURBOQUANT:
        return f"kv:turboquant:{storage.bits}:{storage.value_bits}"
    if storage.kind is StorageKind.AFFINE:
        return f"kv:quant:{storage.bits}:{storage.group_size}"
    return "kv:plain"


def codec_of_signature(signature: str) -> KVCodec | None:
    """The codec a request layout's quantized KV id names (None: not a quantized KV id)."""
    parts = signature.split(":")
    if parts[:2] not in (["kv", "quant"], ["kv", "turboquant"]) or len(parts) < 4:
        return None
    start = int(parts[4].removeprefix("from")) if len(parts) > 4 else 0
    if parts[1] == "turboquant":
        return KVCodec.turboquant(int(parts[2]), int(parts[3]), start)
    return KVCodec(int(parts[2]), int(parts[3]), start)


def ring_signature(max_size: int, keep: int, storage: Storage) -> str:
    """The layout codec id of a sliding-window layer stored as `storage`, e.g.
    kv:rotating:64:0 (plain) or kv:rotating:64:0:turboquant:3:3 (no start: a ring converts
    after its first call)."""
    base = f"kv:rotating:{max_size}:{keep}"
    return base if not storage.packed else base + storage_signature(storage).removeprefix("kv")


def request_layout(layout: list[str], codec: KVCodec) -> list[str]:
    """A model's layout signature under a codec: its plain KV layers take the codec's id, its
    sliding-window layers (without kept tokens) the ring form of it."""
    out = []
    for c in layout:
        if c == "kv:plain":
            out.append(codec.signature())
        elif c.startswith("kv:rotating:") and c.endswith(":0") and c.count(":") == 3:
            max_size = int(c.split(":")[2])
            out.append(ring_signature(max_size, 0, codec.storage))
        else:
            out.append(c)
    return out


def layout_accepts(expected: list[str], stored: list[str]) -> bool:
    """Whether caches captured with per-layer codecs `stored` fit a request layout."""
    if len(expected) != len(stored):
        return False
    for want, got in zip(expected, stored, strict=True):
        codec = codec_of_signature(want)
        if codec is not None:
            if not codec.accepts(got):
                return False
        elif want.startswith("kv:rotating:") and want.count(":") > 3:
            if got not in (want, ":".join(want.split(":")[:4])):  # packed, or not yet converted
                return False
        elif want != got:
            return False
    return True
