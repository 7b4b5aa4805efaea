"""Rows of one storage format and the planes they live in, for the batch KV cache
(kv/batch_cache.py), all of shape (rows, heads, columns, width):
- plain rows: one tensor per side;
- affine rows: (values, scales, biases) planes as mlx-lm's QuantizedKVCache lays them out;
- TurboQuant rows: (codes, norms) planes (kv/turboquant.py), keys and values at their own bits.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as cache_lib

from engine_service.kv.turboquant import TurboQuantPlanes, codec_for, words_for
from engine_service.protocol.kv_codec import PLAIN, Storage, StorageKind

# MLX-CUDA's quantized matmul has no kernel for a column slice of a larger buffer
# (shared/gpu/README.md); this is about affine rows only (TurboQuant's are read elementwise).
# A contiguous copy of every plane every step works but costs a fresh buffer of growing size
# per plane and layer; instead, while a batch holds affine rows, attention reads the whole
# step-grown planes and the mask hides the columns past the last token (zeros: scales and
# biases 0). Metal and the CPU read column slices directly.
FULL_WIDTH_PLANES = mx.default_device() == mx.gpu and not mx.metal.is_available()


def storage_of(cache: Any) -> Storage:
    """The storage format a solo cache holds its tokens in (PLAIN when it holds none)."""
    if cache.keys is None:
        return PLAIN
    stored = getattr(cache, "stored_as", None)  # a TurboQuantRow's
    if stored is not None:
        return stored  # type: ignore[no-any-return]
    if isinstance(cache, cache_lib.QuantizedKVCache):
        return Storage(StorageKind.AFFINE, cache.bits, cache.group_size)
    return PLAIN


class PlaneGroup:
    """Rows of one storage format: planes of shape (rows, heads, columns, width)."""

    def __init__(
        self, storage: Storage, rows: list[int], keys: list[mx.array], values: list[mx.array]
    ):
        self.storage = storage
        self.rows = rows  # batch row of each plane row, ascending
        # [tensor] when plain, [packed, scales, biases] when affine, [codes, norms] TurboQuant
        self.keys = keys
        self.values = values
        self._index: mx.array | None = None

    @property
    def packed(self) -> bool:
        return self.storage.packed

    @property
    def turboquant(self) -> bool:
        return self.storage.kind is StorageKind.TURBOQUANT

    @property
    def planes(self) -> list[mx.array]:
        return [*self.keys, *self.values]

    def index(self) -> mx.array:
        if self._index is None:
            self._index = mx.array(self.rows, dtype=mx.int32)
        return self._index

    def map_planes(self, fn: Any) -> None:
        self.keys = [fn(p) for p in self.keys]
        self.values = [fn(p) for p in self.values]

    def take(self, local: list[int]) -> None:
        """Keeps the plane rows at `local` positions, in that order."""
        if local == list(range(len(self.rows))):
            return
        idx = mx.array(local, dtype=mx.int32)
        self.map_planes(lambda p: p[idx])
        self.rows = [self.rows[i] for i in local]
        self._index = None

    def concat(self, incoming: PlaneGroup) -> None:
        """Appends another group's rows (planes of equal column count), in row order."""
        self.keys = [mx.concatenate([a, b]) for a, b in zip(self.keys, incoming.keys, strict=True)]
        self.values = [
            mx.concatenate([a, b]) for a, b in zip(self.values, incoming.values, strict=True)
        ]
        self.rows = self.rows + incoming.rows
        self._index = None
        self.sort()

    def pad_columns(self, left: int, right: int) -> None:
        """Adds `left` columns before and `right` after (right < 0: drops columns)."""

        def pad(p: mx.array) -> mx.array:
            r = right
            if r < 0:
                p, r = p[..., :r, :], 0
            if left or r:
                p = mx.pad(p, [(0, 0), (0, 0), (left, r), (0, 0)])
            return p

        self.map_planes(pad)

    def cut(self, local: int, start: int, end: int) -> tuple[list[mx.array], list[mx.array]]:
        """Copies of plane row `local`'s columns [start, end): its keys and values planes."""

        def piece(p: mx.array) -> mx.array:
            return mx.contiguous(p[local : local + 1, :, start:end])

        return [piece(p) for p in self.keys], [piece(p) for p in self.values]

    @classmethod
    def gather(
        cls,
        storage: Storage,
        rows: list[int],
        caches: list[Any],
        padding: list[int],
        lengths: list[int],
        width: int,
        shape: tuple[int, int, int, str],
        columns: int = 0,
    ) -> PlaneGroup:
        """The batch rows `rows` of solo caches stored as `storage`, right-aligned at `width`
        columns, in planes of `columns` (>= width; 0: width) so that the next positions fit
        without regrowing them (packed rows keep their bytes).

        Rows of several lengths are written into zero planes (one copy); without the room,
        the first step regrew every plane, a second copy of the whole cache (two rows of 4k
        positions of a 0.6B model on the CPU: 1,066 ms merged and stepped, 493 ms with the
        room). A lone row that fills the width is its tensors followed by the empty columns,
        one copy: MLX elides a write that covers a whole zero plane, so it cost one copy
        before too (at the regrow)."""
        heads, kdim, vdim = shape[:3]
        dtype = getattr(mx, shape[3])
        columns = max(columns, width)
        if len(rows) == 1 and padding[rows[0]] == 0 and caches[rows[0]].keys is not None:
            cache, n = caches[rows[0]], lengths[rows[0]]
            src_k = [cache.keys] if storage == PLAIN else list(cache.keys)
            src_v = [cache.values] if storage == PLAIN else list(cache.values)
            plain = storage == PLAIN
            return cls(
                storage,
                rows,
                [_followed_by_room(p, n, columns, plain) for p in src_k],
                [_followed_by_room(p, n, columns, plain) for p in src_v],
            )
        keys = zeros_like_storage(storage, len(rows), heads, columns, kdim, dtype)
        values = zeros_like_storage(storage, len(rows), heads, columns, vdim, dtype, values=True)
        for local, row in enumerate(rows):
            cache, p, n = caches[row], padding[row], lengths[row]
            if cache.keys is None:
                continue
            src_k = [cache.keys] if storage == PLAIN else list(cache.keys)
            src_v = [cache.values] if storage == PLAIN else list(cache.values)
            for dst, src in zip(keys, src_k, strict=True):
                dst[local : local + 1, :, p : p + n] = src[..., :n, :]
            for dst, src in zip(values, src_v, strict=True):
                dst[local : local + 1, :, p : p + n] = src[..., :n, :]
        return cls(storage, rows, keys, values)

    def append_columns(self, columns: int, shape: tuple[int, int, int, str]) -> None:
        """Adds `columns` empty columns after the last (the planes' first ones if none)."""
        heads, kdim, vdim, dtype = shape[0], shape[1], shape[2], getattr(mx, shape[3])
        n = len(self.rows)
        new_k = zeros_like_storage(self.storage, n, heads, columns, kdim, dtype)
        new_v = zeros_like_storage(self.storage, n, heads, columns, vdim, dtype, values=True)
        if not self.keys:
            self.keys, self.values = new_k, new_v
            return
        self.keys = [mx.concatenate([p, z], axis=2) for p, z in zip(self.keys, new_k, strict=True)]
        self.values = [
            mx.concatenate([p, z], axis=2) for p, z in zip(self.values, new_v, strict=True)
        ]

    @classmethod
    def empty_plain(cls, rows: int, shape: tuple[int, int, int, str]) -> PlaneGroup:
        """`rows` rows with nothing stored: plain planes of no columns."""
        group = cls(PLAIN, list(range(rows)), [], [])
        group.append_columns(0, shape)
        return group

    def sort(self) -> None:
        order = sorted(range(len(self.rows)), key=self.rows.__getitem__)
        self.take(order)

    def encode(self, x: mx.array, values: bool = False) -> list[mx.array]:
        s = self.storage
        if s.kind is StorageKind.PLAIN:
            return [x]
        if s.kind is StorageKind.TURBOQUANT:
            coded = codec_for(x.shape[-1], s.value_bits if values else s.bits).encode(x)
            return [coded.codes, coded.norms]
        return list(mx.quantize(x, group_size=s.group_size, bits=s.bits))

    def encode_pair(
        self, keys: mx.array, values: mx.array
    ) -> tuple[list[mx.array], list[mx.array]]:
        """Keys' and values' planes. TurboQuant keys and values of one codec (same bits, same
        width) are encoded together: one norm, one rotation matmul and one quantize a layer
        instead of two each (a decode step's graph building is its bound on a GPU)."""
        s = self.storage
        if s.kind is StorageKind.TURBOQUANT and s.bits == s.value_bits:
            if keys.shape == values.shape:
                coded = codec_for(keys.shape[-1], s.bits).encode(mx.stack([keys, values]))
                return [coded.codes[0], coded.norms[0]], [coded.codes[1], coded.norms[1]]
        return self.encode(keys), self.encode(values, values=True)

    def decode(
        self, planes: list[mx.array], dtype: mx.Dtype, dim: int, values: bool = False
    ) -> mx.array:
        """The vectors of `planes` (this group's keys, or its values), `dim` wide."""
        s = self.storage
        if s.kind is StorageKind.PLAIN:
            return planes[0]
        if s.kind is StorageKind.TURBOQUANT:
            coded = turboquant_planes(planes, s, dim, values)
            return coded.codec.decode(coded).astype(dtype)
        packed, scales, biases = planes
        return mx.dequantize(packed, scales, biases, group_size=s.group_size, bits=s.bits).astype(
            dtype
        )


def turboquant_planes(
    planes: list[mx.array], storage: Storage, dim: int, values: bool
) -> TurboQuantPlanes:
    """A TurboQuant group's keys or values planes as the codec's type."""
    codec = codec_for(dim, storage.value_bits if values else storage.bits)
    return TurboQuantPlanes(planes[0], planes[1], codec)


def _followed_by_room(plane: mx.array, n: int, columns: int, as_is: bool = False) -> mx.array:
    """A row's first n columns, then zero columns up to `columns`: one new array. as_is (plain
    planes): a plane of `columns` already is taken as it is, no copy (a store hit lands so:
    checkpoints/device_landing.host_plane); its columns past n are never read unmasked, and
    plain KV there is finite (zeros, or positions a trim let go)."""
    if as_is and plane.shape[2] == columns:
        return plane
    head = plane[..., :n, :]
    if columns == n:
        return head
    room = mx.zeros((*plane.shape[:2], columns - n, plane.shape[3]), dtype=plane.dtype)
    return mx.concatenate([head, room], axis=2)


def zeros_like_storage(
    storage: Storage,
    rows: int,
    heads: int,
    columns: int,
    dim: int,
    dtype: mx.Dtype,
    values: bool = False,
) -> list[mx.array]:
    """Empty planes of a group (TurboQuant zeros decode to zero vectors: norm 0)."""
    if storage.kind is StorageKind.PLAIN:
        return [mx.zeros((rows, heads, columns, dim), dtype=dtype)]
    if storage.kind is StorageKind.TURBOQUANT:
        words = words_for(dim, storage.value_bits if values else storage.bits)
        return [
            mx.zeros((rows, heads, columns, words), dtype=mx.uint32),
            mx.zeros((rows, heads, columns, 1), dtype=mx.float32),
        ]
    bits, group = storage.bits, storage.group_size
    return [
        mx.zeros((rows, heads, columns, dim * bits // 32), dtype=mx.uint32),
        mx.zeros((rows, heads, columns, dim // group), dtype=dtype),
        mx.zeros((rows, heads, columns, dim // group), dtype=dtype),
    ]


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def row_shape(caches: list[Any]) -> tuple[int, int, int, str]:
    """(heads, key width, value width, dtype) of the first row holding anything."""
    for cache in caches:
        if cache.keys is None:
            continue
        shape = getattr(cache, "row_shape", None)  # a TurboQuantRow knows its own
        if shape is not None:
            return shape  # type: ignore[no-any-return]
        if isinstance(cache, cache_lib.QuantizedKVCache):
            assert cache.keys is not None and cache.values is not None
            packed, scales, _ = cache.keys
            per_word = 32 // cache.bits
            return (
                packed.shape[1],
                packed.shape[-1] * per_word,
                cache.values[0].shape[-1] * per_word,
                dtype_name(scales.dtype),
            )
        keys, values = cache.keys, cache.values
        return keys.shape[1], keys.shape[3], values.shape[3], dtype_name(keys.dtype)
    raise ValueError("no row holds any tokens")


def only_affine(groups: list[PlaneGroup], name: str) -> Storage:
    """The storage of a batch held in one affine group; AttributeError(name) otherwise, so
    that `hasattr(cache, "bits")` (how mlx-lm picks its quantized attention) is False."""
    if len(groups) != 1 or groups[0].storage.kind is not StorageKind.AFFINE:
        raise AttributeError(name)
    return groups[0].storage


def attention_planes(
    groups: list[PlaneGroup],
    shape: tuple[int, int, int, str],
    dtype: mx.Dtype,
    live: Any,
) -> tuple[Any, Any]:
    """What attention reads of a batch's groups, each plane through `live` (the columns
    attention sees): one plain group's tensors (plain SDPA), one affine group's planes
    (mlx-lm's quantized SDPA), one TurboQuant group's `TurboQuantPlanes` (routed by
    kv/attention_routing.py), or for mixed groups one plain tensor in batch order, the packed
    rows decoded for the step."""
    kdim, vdim = shape[1], shape[2]
    if len(groups) == 1:
        g = groups[0]
        if not g.packed:
            return live(g.keys[0]), live(g.values[0])
        if g.turboquant:
            return (
                turboquant_planes([live(p) for p in g.keys], g.storage, kdim, False),
                turboquant_planes([live(p) for p in g.values], g.storage, vdim, True),
            )
        return tuple(live(p) for p in g.keys), tuple(live(p) for p in g.values)
    ks = [g.decode([live(p) for p in g.keys], dtype, kdim) for g in groups]
    vs = [g.decode([live(p) for p in g.values], dtype, vdim, True) for g in groups]
    rows = [r for g in groups for r in g.rows]
    order = mx.array(sorted(range(len(rows)), key=rows.__getitem__), dtype=mx.int32)
    return mx.concatenate(ks)[order], mx.concatenate(vs)[order]


def group_of(groups: list[PlaneGroup], storage: Storage) -> PlaneGroup | None:
    return next((g for g in groups if g.storage == storage), None)


def join_group(groups: list[PlaneGroup], incoming: PlaneGroup) -> None:
    """Adds rows to the group of their format (planes of equal column count)."""
    group = group_of(groups, incoming.storage)
    if group is None:
        groups.append(incoming)
    else:
        group.concat(incoming)


def convert_rows(groups: list[PlaneGroup], due: dict[Storage, list[int]]) -> list[PlaneGroup]:
    """The groups after the plain group's rows at `due`'s local positions moved into their
    packed groups. Whole columns are encoded: quantization works per position, so the live
    ones get the bytes they would alone, and padding columns (zeros or masked activations)
    stay finite."""
    plain = group_of(groups, PLAIN)
    assert plain is not None
    moved: set[int] = set()
    for storage, positions in due.items():
        moving = PlaneGroup(storage, [plain.rows[i] for i in positions], [], [])
        idx = mx.array(positions, dtype=mx.int32)
        moving.keys = moving.encode(plain.keys[0][idx])
        moving.values = moving.encode(plain.values[0][idx], values=True)
        moved.update(positions)
        join_group(groups, moving)
    plain.take([i for i in range(len(plain.rows)) if i not in moved])
    return [g for g in groups if g.rows]


def keep_rows(groups: list[PlaneGroup], keep: list[int]) -> list[PlaneGroup]:
    """The groups holding only the batch rows `keep`, renumbered in that order (a filter)."""
    new_row = {old: new for new, old in enumerate(keep)}
    for g in groups:
        g.take([i for i, r in enumerate(g.rows) if r in new_row])
        g.rows = [new_row[r] for r in g.rows]
        g._index = None
        g.sort()
    return [g for g in groups if g.rows]
