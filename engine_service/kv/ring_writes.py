"""How a batch of ring rows (kv/ring_cache.py) takes each step's tokens and what attention
reads: mlx-lm's `BatchRotatingKVCache` updates and mask, step for step, on plane groups
(kv/planes.py), and the move of plain rows into their packed group after their first call.

A mixin: the attributes below are BatchQuantizedRingCache's. kv/ring_cache.py's docstring
explains the batch; rows joining, leaving and rolling back are there.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import dynamic_roll

from engine_service.kv.planes import (
    FULL_WIDTH_PLANES,
    PlaneGroup,
    attention_planes,
    convert_rows,
    dtype_name,
    group_of,
    only_affine,
)
from engine_service.protocol.kv_codec import PLAIN, KVCodec, Storage


class RingWrites:
    """A mixin: the attributes below are BatchQuantizedRingCache's."""

    step: int
    max_size: int
    left_padding: mx.array
    offset: mx.array
    rotated: bool
    _codecs: list[KVCodec]
    _groups: list[PlaneGroup]
    _write_at: int  # where the next column is written (mlx-lm's `_idx`)
    _tokens_seen: int  # tokens the longest row has seen (mlx-lm's `_offset`)
    _prefill_lengths: mx.array | None  # right-padded prompt rows' lengths, until finalize
    _shape: tuple[int, int, int, str] | None
    _waiting: int | None

    # -- what attention sees -----------------------------------------------------------------

    @property
    def bits(self) -> int:
        return only_affine(self._groups, "bits").bits

    @property
    def group_size(self) -> int:
        return only_affine(self._groups, "group_size").group_size

    def _fetch(self, dtype: mx.Dtype) -> tuple[Any, Any]:
        assert self._shape is not None
        n = self._tokens_seen

        def live(p: mx.array) -> mx.array:
            if n >= p.shape[2]:
                return p
            # MLX-CUDA's quantized matmul cannot read a column slice (kv/batch_cache.py).
            return mx.contiguous(p[..., :n, :]) if FULL_WIDTH_PLANES else p[..., :n, :]

        return attention_planes(self._groups, self._shape, dtype, live)

    # -- column and row operations over every group -----------------------------------------

    def _cols(self) -> int:
        return int(self._groups[0].keys[0].shape[2]) if self._groups else 0

    def _map(self, fn: Any) -> None:
        for g in self._groups:
            g.map_planes(fn)

    def _roll_rows(self, roll: mx.array) -> None:
        for g in self._groups:
            shifts = roll[g.index()][:, None]
            g.map_planes(lambda p, s=shifts: dynamic_roll(p, s, axis=2))

    def _to_temporal_order(self) -> None:
        if self.rotated:
            idx = self._write_at
            self._map(lambda p: mx.roll(p, -idx, 2))
            self._write_at = self._cols()
            self.rotated = False

    def _encoded(self, keys: mx.array, values: mx.array) -> list[tuple[list[Any], list[Any]]]:
        whole = len(self._groups) == 1
        out = []
        for g in self._groups:
            k = keys if whole else keys[g.index()]
            v = values if whole else values[g.index()]
            out.append(g.encode_pair(k, v))
        return out

    def _convert_due(self) -> None:
        """Moves plain rows with a quantized codec into their packed groups (after their
        first call: a ring converts at once). A row that joined a batch already holding
        columns (a prompt batch extended while another row prefills) holds only padding until
        its own first call, which attends over its plain keys as alone: it waits."""
        if self._waiting == 0:
            return  # most steps: nothing waits (recounted after rows join or leave)
        plain = group_of(self._groups, PLAIN)
        if plain is None or not plain.keys:
            return
        held = self.offset.tolist()  # tokens each row holds (read only while rows wait)
        due: dict[Storage, list[int]] = {}
        waiting = 0
        for local, row in enumerate(plain.rows):
            if not self._codecs[row].quantized:
                continue
            if held[row] > 0:  # type: ignore[index,operator]
                due.setdefault(self._codecs[row].storage, []).append(local)
            else:
                waiting += 1
        if due:
            self._groups = convert_rows(self._groups, due)
        self._waiting = waiting

    # -- updates (mlx-lm's BatchRotatingKVCache, on groups) ----------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if self._shape is None:
            b, heads, _, kdim = keys.shape
            self._shape = (heads, kdim, values.shape[3], dtype_name(keys.dtype))
        self._convert_due()
        if keys.shape[2] == 1:
            self._in_place_update(keys, values)
        else:
            self._concat_update(keys, values)
        first = self._groups[0]
        first.keys[0] = mx.depends(first.keys[0], (self.left_padding, self.offset))
        return self._fetch(keys.dtype)

    def _concat_update(self, keys: mx.array, values: mx.array) -> None:
        steps = keys.shape[2]
        if not self._groups:
            self._groups = [PlaneGroup(PLAIN, list(range(keys.shape[0])), [keys], [values])]
        else:
            self._to_temporal_order()
            if self._cols() > self._write_at:
                end = self._write_at
                self._map(lambda p: p[..., :end, :])
            if self._prefill_lengths is not None:
                roll = mx.maximum(0, self.offset - self._prefill_lengths)
                self._roll_rows(roll)
                self.left_padding = self.left_padding + roll
                self.offset = self.offset - roll
            trim = self._write_at - self.max_size + 1  # every token keeps max_size of context
            if trim > 0:
                self.left_padding = self.left_padding - trim
            for g, (ks, vs) in zip(self._groups, self._encoded(keys, values), strict=True):
                cut = max(trim, 0)
                g.keys = [
                    mx.concatenate([p[..., cut:, :], n], axis=2)
                    for p, n in zip(g.keys, ks, strict=True)
                ]
                g.values = [
                    mx.concatenate([p[..., cut:, :], n], axis=2)
                    for p, n in zip(g.values, vs, strict=True)
                ]
        self.offset = self.offset + steps
        self._tokens_seen += steps
        self._write_at = self._cols()

    def _in_place_update(self, keys: mx.array, values: mx.array) -> None:
        if self._prefill_lengths is not None:
            raise RuntimeError("finalize() must be called before decoding")
        assert self._shape is not None
        steps = keys.shape[2]
        prev = self._tokens_seen
        if not self._groups:
            self._groups = [PlaneGroup(PLAIN, list(range(keys.shape[0])), [], [])]
        if not self._groups[0].keys or (prev >= self._cols() and self._cols() < self.max_size):
            size = min(self.step, self.max_size - prev)
            for g in self._groups:
                g.append_columns(size, self._shape)
            self._write_at = prev
        trim = self._cols() - self.max_size
        if trim > 0:
            self._map(lambda p: p[..., trim:, :])
            self._write_at = self.max_size
            self.left_padding = self.left_padding - trim
        if self._write_at == self.max_size:
            self.rotated = True
            self._write_at = 0
        if self.rotated:
            self.left_padding = self.left_padding - steps
        at = self._write_at
        for g, (ks, vs) in zip(self._groups, self._encoded(keys, values), strict=True):
            for plane, part in zip(g.keys, ks, strict=True):
                plane[..., at : at + steps, :] = part
            for plane, part in zip(g.values, vs, strict=True):
                plane[..., at : at + steps, :] = part
        self._tokens_seen += steps
        self.offset = self.offset + steps
        self._write_at += steps

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
            pad = mx.array(left_padding)
            self.left_padding = self.left_padding + pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            assert lengths is not None
            self._prefill_lengths = mx.array(lengths) + self.offset

    def finalize(self) -> None:
        if self._prefill_lengths is not None:
            roll = mx.maximum(0, self.offset - self._prefill_lengths)
            self._roll_rows(roll)
            self.left_padding = self.left_padding + roll
            self.offset = self.offset - roll
            self._prefill_lengths = None

    def make_mask(
        self,
        N: int,  # noqa: N803
        window_size: int | None = None,
        return_array: bool = False,
    ) -> mx.array:
        """mlx-lm's BatchRotatingKVCache.make_mask, unchanged (it reads only the bookkeeping)."""
        left_padding = self.left_padding
        window_size = window_size or self.max_size
        offset = min(self.max_size - 1, self._tokens_seen)
        rinds = mx.arange(offset + N)
        linds = mx.arange(offset, offset + N) if offset else rinds
        linds = linds[:, None]
        rinds = rinds[None]
        mask = linds >= rinds
        mask &= linds < rinds + window_size
        if (trim_size := self._write_at - self.max_size + int(N > 1)) > 0:
            left_padding = left_padding - trim_size
        rotated = N == 1 and (self.rotated or self._write_at >= self.max_size)
        if rotated:
            left_padding = left_padding - 1
        mask = mask & (rinds >= mx.expand_dims(left_padding, (1, 2, 3)))
        if rotated:
            idx = self._write_at
            if idx >= self.max_size:
                idx = 0
            mask = mx.roll(mask, idx + 1, -1)
        return mask
