"""How a batch of KV rows (kv/batch_cache.py) takes each step's tokens and what attention
reads: the planes written column by column (grown 256 columns at a time), rows moved into
their packed group once they reach their codec's start, the mask, and the right padding of a
prompt batch rolled away (prepare, finalize).

A mixin: the attributes below are BatchQuantizedKVCache's. kv/batch_cache.py's docstring
explains the batch; rows joining, leaving and rolling back are there.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import dynamic_roll

from engine_service.kv.planes import (
    FULL_WIDTH_PLANES,
    PlaneGroup,
    attention_planes,
    convert_rows,
    dtype_name,
    group_of,
    join_group,
    only_affine,
)
from engine_service.protocol.kv_codec import PLAIN, KVCodec, Storage, StorageKind

WIDE = frozenset({StorageKind.TURBOQUANT})  # the formats whose attention reads whole planes
WIDE_AFFINE = WIDE | {StorageKind.AFFINE}


class BatchWrites:
    """A mixin: the attributes below are BatchQuantizedKVCache's."""

    step: int
    wide_reads: bool
    _lp: list[int]  # host copy of the per-row left padding
    _written: int  # columns written: a row's tokens end there (BatchKVCache's `_idx`)
    _cap: int  # columns the planes have
    _codecs: list[KVCodec]
    _groups: list[PlaneGroup]
    _shape: tuple[int, int, int, str] | None
    _right_padding_to_roll: list[int] | None
    _waiting: int | None
    offset: mx.array
    left_padding: mx.array

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
        prev = self._written
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
        self._written = end
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
        n = self._cap if full else self._written

        def live(p: mx.array) -> mx.array:
            return p if full else p[..., :n, :]

        assert self._shape is not None
        return attention_planes(self._groups, self._shape, dtype, live)

    def make_mask(
        self,
        N: int,  # noqa: N803
        return_array: bool = False,
        **kwargs: Any,
    ) -> mx.array | str | None:
        if not return_array and kwargs.get("window_size") is None and self._plain_unpadded():
            # What mlx-lm's KVCache gives a lone prompt: MLX's fused attention takes "causal"
            # (bottom-right, the same bits on the CPU), where an array mask costs the
            # unfused path on MLX-CUDA (mlx-lm's batch caches: +12 ms a 16-token turn over
            # 32k positions of the 0.6B shape, bench/step_floor_probe.py).
            return "causal" if N > 1 else None
        mask: mx.array = create_causal_mask(
            N, offset=self._written, left_padding=self.left_padding, **kwargs
        )
        if self._full_width():
            extra = self._cap_after(N) - mask.shape[-1]
            mask = mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, extra)])
        return mask

    def _plain_unpadded(self) -> bool:
        """No row has left padding and every row is plain KV with no codec to convert to:
        attention reads exactly the written columns, all of them."""
        if any(self._lp) or self.wide_reads or any(c.quantized for c in self._codecs):
            return False
        return all(g.storage.kind is StorageKind.PLAIN for g in self._groups)

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
        held = self._written - self._lp[row]
        return codec.quantized and held > 0 and held >= codec.start

    def _cap_after(self, steps: int) -> int:
        """Columns the planes will have once `steps` more positions are written (_grow)."""
        prev = self._written
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
            self._right_padding_to_roll = list(right_padding)

    def finalize(self) -> None:
        """Rolls right-padded prefill rows so their tokens end at `_written` (left padding)."""
        pad = self._right_padding_to_roll
        if pad is None:
            return
        for group in self._groups:
            shifts = mx.array([pad[r] for r in group.rows])[:, None]
            group.map_planes(lambda p, s=shifts: dynamic_roll(p, s, axis=2))
        self._lp = [a + b for a, b in zip(self._lp, pad, strict=True)]
        self._sync_positions()
        self._right_padding_to_roll = None

    def _sync_positions(self) -> None:
        self.left_padding = mx.array(self._lp)
        self.offset = mx.array([self._written - p for p in self._lp])
