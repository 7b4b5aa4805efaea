"""Batched KV caches whose rows may be quantized (affine or TurboQuant), each on its own
schedule.

mlx-lm quantizes a solo request's cache (`QuantizedKVCache`, `--kv-bits`) but its
`BatchGenerator` cannot batch one: `QuantizedKVCache` has no `merge`, and `BatchKVCache`
holds one plain tensor for every row. No library has a batch cache whose rows differ in
codec, so this module writes one, on mlx-lm's cache contract (merge, extend, filter,
extract, prepare/finalize, make_mask, trim, state/meta_state/from_state).

Rows are kept in *groups* by storage format (kv/planes.py): one plain group (the model's
dtype), one affine group per (bits, group size), holding packed planes (values, scales,
biases) as mlx-lm's `QuantizedKVCache` does, and one TurboQuant group per (key bits, value
bits), holding (codes, norms) planes (kv/turboquant.py). Every group shares the batch's column
axis: a row's tokens end at column `_idx` and begin after its left padding, exactly as in
`BatchKVCache`.

A row with a quantized codec stays plain until it holds `start` tokens after a model call,
then moves into its packed group once (mlx-lm's `maybe_quantize_kv_cache` converts a solo
cache at the same point). Attention then runs on:
- one plain group: the plain tensors, mlx's fused SDPA (what BatchKVCache does);
- one affine group: the packed planes through mlx-lm's `quantized_scaled_dot_product_attention`
  (`bits`/`group_size` are visible on the cache only in this state, which is how
  `scaled_dot_product_attention` picks the quantized path);
- one TurboQuant group: the planes are handed to attention as `TurboQuantPlanes`, which
  kv/attention_routing.py sends to `turboquant_attention` (rotated domain);
- several groups: packed rows are dequantized for this step into one plain tensor. The values
  are those the packed path reads; only the rounding order of the arithmetic differs.

Moving rows (merge, extend, filter, extract) copies packed bytes; nothing is decoded and
re-encoded. Sliding-window (rotating) layers are not handled here: they stay plain.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import dynamic_roll

from engine_service.kv import ring_cache as quantized_ring
from engine_service.kv.batch_state import BatchState
from engine_service.kv.planes import (
    FULL_WIDTH_PLANES,
    PlaneGroup,
    attention_planes,
    convert_rows,
    dtype_name,
    group_of,
    join_group,
    keep_rows,
    only_affine,
    row_shape,
    storage_of,
)
from engine_service.kv.rows import PackedRow, PlainRow, Row, TurboQuantRow, adopt_row, codec_of
from engine_service.model.mlx_compat import BaseCache
from engine_service.protocol.kv_codec import PLAIN, PLAIN_KV, KVCodec, Storage, StorageKind

__all__ = ["BatchQuantizedKVCache", "PackedRow", "PlainRow", "TurboQuantRow", "adopt_row"]

WIDE = frozenset({StorageKind.TURBOQUANT})  # the formats whose attention reads whole planes
WIDE_AFFINE = WIDE | {StorageKind.AFFINE}


class BatchQuantizedKVCache(BatchState, BaseCache):
    """A left-padded batch of KV rows in mixed storage formats (see the module docstring)."""

    step = 256
    # Attention reads whole step-grown planes, the mask hiding the columns past `_idx`: set
    # by speculative batches, whose multi-position calls would otherwise meet a new key length
    # every round (MLX-CUDA builds attention kernels per shape).
    wide_reads = False

    def __init__(self, left_padding: list[int], codecs: list[KVCodec] | None = None) -> None:
        # Host copy of the per-row left padding; a row's offset (tokens held, RoPE position)
        # is always _idx - _lp[row], as in BatchKVCache.
        self._lp = list(left_padding)
        self.left_padding = mx.array(self._lp)
        self.offset = mx.array([-p for p in left_padding])
        self._codecs = list(codecs) if codecs is not None else [PLAIN_KV] * len(left_padding)
        self._groups: list[PlaneGroup] = []
        self._idx = 0
        self._cap = 0
        self._right_padding: list[int] | None = None
        self._waiting: int | None = None  # plain rows with a quantized codec (None: recount)
        # (heads, key width, value width, dtype name), known once a row holds something
        # (a name, not an mx.Dtype: BatchGenerator deep-copies caches and Dtype won't copy).
        self._shape: tuple[int, int, int, str] | None = None

    # -- what attention sees -----------------------------------------------------------------

    @property
    def bits(self) -> int:
        return only_affine(self._groups, "bits").bits

    @property
    def group_size(self) -> int:
        return only_affine(self._groups, "group_size").group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        # Runs once per layer per step: the common case (one group, nothing to convert)
        # does what BatchKVCache does and little else, as graph building is on the hot path.
        full = self._full_width()  # before converting, as make_mask decided
        if self._waiting != 0:
            self._convert_due()
        steps = keys.shape[2]
        prev = self._idx
        if prev + steps > self._cap or not self._groups:
            self._make_room(keys, values, prev, steps)
        end = prev + steps
        groups = self._groups
        if len(groups) == 1 and not groups[0].packed:
            group = groups[0]
            group.keys[0][..., prev:end, :] = keys
            group.values[0][..., prev:end, :] = values
        else:
            whole = len(groups) == 1
            for group in groups:
                k = keys if whole else keys[group.index()]
                v = values if whole else values[group.index()]
                kparts, vparts = group.encode_pair(k, v)
                for plane, part in zip(group.keys, kparts, strict=True):
                    plane[..., prev:end, :] = part
                for plane, part in zip(group.values, vparts, strict=True):
                    plane[..., prev:end, :] = part
        self._idx = end
        self.offset = self.offset + steps
        return self._fetch(keys.dtype, full)

    def _make_room(self, keys: mx.array, values: mx.array, prev: int, steps: int) -> None:
        batch, heads, _, kdim = keys.shape
        if self._shape is None:
            self._shape = (heads, kdim, values.shape[3], dtype_name(keys.dtype))
        if not self._groups:
            self._groups = [PlaneGroup(PLAIN, list(range(batch)), [], [])]
            self._cap = 0
        if prev + steps > self._cap:
            self._grow(prev, steps)

    def _fetch(self, dtype: mx.Dtype, full: bool = False) -> tuple[Any, Any]:
        n = self._cap if full else self._idx

        def live(p: mx.array) -> mx.array:
            return p if full else p[..., :n, :]

        assert self._shape is not None
        return attention_planes(self._groups, self._shape, dtype, live)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:  # noqa: N803
        mask: mx.array = create_causal_mask(
            N, offset=self._idx, left_padding=self.left_padding, **kwargs
        )
        if self._full_width():
            extra = self._cap_after(N) - mask.shape[-1]
            mask = mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, extra)])
        return mask

    def _full_width(self) -> bool:
        """Whether this step's attention reads whole planes: TurboQuant rows always (their
        compiled decode then sees one shape per 256 steps), affine rows on MLX-CUDA
        (FULL_WIDTH_PLANES). Decided from the state before the update, so make_mask (first
        layer) and every layer agree."""
        if not self._groups:
            return False
        if self.wide_reads:
            return True
        wide = WIDE_AFFINE if FULL_WIDTH_PLANES else WIDE
        if any(g.storage.kind in wide for g in self._groups):
            return True
        plain = self._group(PLAIN)
        if plain is None or not plain.keys or self._waiting == 0:
            return False  # _waiting 0: no plain row has a quantized codec (most batches)
        return any(self._due(r) and self._codecs[r].storage.kind in wide for r in plain.rows)

    def _due(self, row: int) -> bool:
        codec = self._codecs[row]
        held = self._idx - self._lp[row]
        return codec.quantized and held > 0 and held >= codec.start

    def _cap_after(self, steps: int) -> int:
        """Columns the planes will have once `steps` more positions are written (_grow)."""
        prev = self._idx
        if prev + steps <= self._cap:
            return self._cap
        extra = (self.step + steps - 1) // self.step * self.step
        return (prev if self._cap and prev % self.step != 0 else self._cap) + extra

    # -- conversion --------------------------------------------------------------------------

    def _convert_due(self) -> None:
        """Moves rows that have reached their codec's start into their packed group."""
        plain = self._group(PLAIN)
        if plain is None:
            # No plain rows: none to convert, but an empty batch (no groups yet) has not
            # counted its rows.
            self._waiting = 0 if self._groups else None
            return
        if self._waiting is None:  # recounted after rows move; most steps skip the scan
            self._waiting = sum(self._codecs[r].quantized for r in plain.rows)
        if not self._waiting:
            return
        if not plain.keys:  # nothing stored yet: rows convert after their first call
            return
        due: dict[Storage, list[int]] = {}
        for local, row in enumerate(plain.rows):
            if self._due(row):
                due.setdefault(self._codecs[row].storage, []).append(local)
        if not due:
            return
        self._groups = convert_rows(self._groups, due)
        self._waiting = None

    def _group(self, storage: Storage) -> PlaneGroup | None:
        return group_of(self._groups, storage)

    def _join(self, incoming: PlaneGroup) -> None:
        join_group(self._groups, incoming)

    # -- growth and padding ------------------------------------------------------------------

    def _grow(self, prev: int, steps: int) -> None:
        assert self._shape is not None
        extra = (self.step + steps - 1) // self.step * self.step
        for group in self._groups:
            if self._cap and prev % self.step != 0:
                group.map_planes(lambda p: p[..., :prev, :])
            group.append_columns(extra, self._shape)
        self._cap = (prev if self._cap and prev % self.step != 0 else self._cap) + extra

    def prepare(
        self,
        *,
        left_padding: list[int] | None = None,
        lengths: list[int] | None = None,
        right_padding: list[int] | None = None,
    ) -> None:
        if left_padding is not None:
            if self._groups:
                raise ValueError("Left padding can only be added to an empty batch cache")
            self._lp = [a + b for a, b in zip(self._lp, left_padding, strict=True)]
            self._sync_positions()
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = list(right_padding)

    def finalize(self) -> None:
        """Rolls right-padded prefill rows so their tokens end at `_idx` (left padding)."""
        pad = self._right_padding
        if pad is None:
            return
        for group in self._groups:
            shifts = mx.array([pad[r] for r in group.rows])[:, None]
            group.map_planes(lambda p, s=shifts: dynamic_roll(p, s, axis=2))
        self._lp = [a + b for a, b in zip(self._lp, pad, strict=True)]
        self._sync_positions()
        self._right_padding = None

    # -- rows joining and leaving ------------------------------------------------------------

    def filter(self, batch_indices: Any) -> None:
        keep = [int(i) for i in batch_indices]
        self._waiting = None
        self._groups = keep_rows(self._groups, keep)
        self._lp = [self._lp[i] for i in keep]
        self._codecs = [self._codecs[i] for i in keep]
        if self._right_padding is not None:
            self._right_padding = [self._right_padding[i] for i in keep]
        shift = min(self._lp) if self._lp else 0
        if shift > 0 and self._groups:
            for group in self._groups:
                group.map_planes(lambda p: p[..., shift:, :])
            self._idx -= shift
            self._cap -= shift
            self._lp = [p - shift for p in self._lp]
        self._sync_positions()

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if not isinstance(other, BatchQuantizedKVCache):
            raise TypeError(f"cannot batch {type(other).__name__} with BatchQuantizedKVCache")
        base = len(self._lp)
        self._waiting = None
        if self._groups or other._groups:
            shape = self._shape or other._shape
            assert shape is not None
            self._shape = shape
            self._materialize_empty(shape)
            other._materialize_empty(shape)
            width = max(self._idx, other._idx)
            columns = max(self._cap, other._cap)
            for side in (self, other):
                left = width - side._idx
                right = columns - side._cap - left
                side._pad_columns(left, right)
            for group in other._groups:
                self._join(
                    PlaneGroup(
                        group.storage, [r + base for r in group.rows], group.keys, group.values
                    )
                )
            self._idx, self._cap = width, columns
        self._lp += other._lp
        self._codecs += other._codecs
        if self._right_padding is not None or other._right_padding is not None:
            self._right_padding = (self._right_padding or [0] * base) + (
                other._right_padding or [0] * len(other._lp)
            )
        self._sync_positions()

    def _sync_positions(self) -> None:
        self.left_padding = mx.array(self._lp)
        self.offset = mx.array([self._idx - p for p in self._lp])

    def _materialize_empty(self, shape: tuple[int, int, int, str]) -> None:
        """Gives rows with nothing stored yet (a batch with no tensors) plain zero planes."""
        if self._groups or not self._lp:
            return
        self._groups = [PlaneGroup.empty_plain(len(self._lp), shape)]
        self._idx = self._cap = 0

    def _pad_columns(self, left: int, right: int) -> None:
        for group in self._groups:
            group.pad_columns(left, right)
        self._lp = [p + left for p in self._lp]
        self._idx += left
        self._cap += left + right

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        """A batch of solo rows (PlainRow/PackedRow/TurboQuantRow or mlx-lm's
        KVCache/QuantizedKVCache), right-aligned at the longest; packed rows keep their bytes."""
        codecs = [codec_of(c) for c in caches]
        lengths = [0 if c.keys is None else int(c.offset) for c in caches]
        width = max(lengths)
        if width == 0:
            return cls([0] * len(caches), codecs)
        padding = [width - n for n in lengths]
        batch = cls(padding, codecs)
        batch._shape = row_shape(caches)
        formats: dict[Storage, list[int]] = {}
        for row, cache in enumerate(caches):
            formats.setdefault(storage_of(cache), []).append(row)
        for storage, rows in formats.items():
            batch._groups.append(
                PlaneGroup.gather(storage, rows, caches, padding, lengths, width, batch._shape)
            )
        batch._idx = batch._cap = width
        batch._sync_positions()
        return batch

    def extract(self, idx: int) -> PlainRow | PackedRow | TurboQuantRow:
        """Row idx as a solo cache: a copy of its plain tensors or of its packed bytes."""
        codec = self._codecs[idx]
        start, end = self._lp[idx], self._idx
        for group in self._groups:
            if idx in group.rows:
                keys, values = group.cut(group.rows.index(idx), start, end)
                row: PlainRow | PackedRow | TurboQuantRow
                if group.turboquant:
                    row = TurboQuantRow(codec, self._shape)
                    row.keys, row.values = (keys[0], keys[1]), (values[0], values[1])
                elif group.packed:
                    row = PackedRow(codec)
                    row.keys, row.values = tuple(keys), tuple(values)
                else:
                    row = PlainRow(codec)
                    row.keys, row.values = keys[0], values[0]
                row.offset = end - start
                return row
        return PlainRow(codec)

    # -- mlx-lm's cache contract -------------------------------------------------------------

    def row_storage(self, idx: int) -> Storage:
        for group in self._groups:
            if idx in group.rows:
                return group.storage
        return PLAIN

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def rollback(self, counts: list[int]) -> None:
        """Forgets each row's last `counts[row]` tokens (speculative rows' rejected drafts).

        The batch trims what every row gives back; a row giving back more is shifted right by
        the rest (dynamic_roll, as `finalize` does for right padding) and its left padding
        grows, so the rows keep one column axis and one `_idx`. Tokens keep their order."""
        least = min(counts)
        self.trim(least)
        extra = [c - least for c in counts]
        if not any(extra):
            return
        for group in self._groups:
            if any(extra[r] for r in group.rows):
                shifts = mx.array([extra[r] for r in group.rows])[:, None]
                group.map_planes(lambda p, s=shifts: dynamic_roll(p, s, axis=2))
        self._lp = [p + e for p, e in zip(self._lp, extra, strict=True)]
        self._sync_positions()

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return not self._groups

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for g in self._groups for p in g.planes)


# Solo rows merge into this batch (kv/rows.py cannot import it: it is imported from here).
Row.batch_type = BatchQuantizedKVCache
# Solo ring rows merge into their batch (kv/ring_cache.py sets RingRow.batch_type on import).
quantized_ring.register()
