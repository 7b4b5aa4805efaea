"""mlx-lm's `state` / `meta_state` / `from_state` for BatchQuantizedKVCache (kv/batch_cache.py):
its planes as a flat array list, and the rest (groups, padding, codecs, shape) as JSON, so a
batch cache survives mlx-lm's prompt-cache save/load and deep copies."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

import mlx.core as mx

from engine_service.kv.planes import PlaneGroup
from engine_service.protocol.kv_codec import KVCodec, Storage

S = TypeVar("S", bound="BatchState")


@dataclass(frozen=True)
class DecodeState:
    """What a compiled decode step reads of a plain batch cache (loop/compiled_decode.py)."""

    keys: mx.array  # (rows, heads, capacity, width): the whole plane
    values: mx.array
    offset: mx.array
    left_padding: mx.array
    column: int  # where the next token is written


class BatchState:
    """A mixin: the attributes below are BatchQuantizedKVCache's."""

    _lp: list[int]
    _written: int
    _cap: int
    _codecs: list[KVCodec]
    _groups: list[PlaneGroup]
    _shape: tuple[int, int, int, str] | None
    _right_padding_to_roll: list[int] | None
    _waiting: int | None
    offset: mx.array
    left_padding: mx.array

    def decode_state(self) -> DecodeState | None:
        """The planes and offsets of a one-token step, with room for that token; None when
        this batch is not one plain group with nothing to convert or prepare."""
        if (
            len(self._groups) != 1
            or self._groups[0].packed
            or self._right_padding_to_roll is not None
        ):
            return None
        if self._waiting != 0 or not self._groups[0].keys:
            return None  # rows due to be quantized, or not counted yet: the eager path
        if self._written + 1 > self._cap:
            return None  # the eager step grows the planes; the next one compiles
        group = self._groups[0]
        return DecodeState(
            group.keys[0], group.values[0], self.offset, self.left_padding, self._written
        )

    def adopt_decode(self, keys: mx.array, values: mx.array, offset: mx.array) -> None:
        """The planes and offsets after a compiled step wrote one token at decode_state's
        column."""
        group = self._groups[0]
        group.keys, group.values = [keys], [values]
        self.offset = offset
        self._written += 1

    @property
    def state(self) -> list[mx.array]:
        return [p for g in self._groups for p in g.planes] + [self.offset, self.left_padding]

    @state.setter
    def state(self, v: list[mx.array]) -> None:
        self._state_arrays = list(v)

    @property
    def meta_state(self) -> str:
        assert self._shape is not None or not self._groups
        heads, kdim, vdim, dtype = self._shape or (0, 0, 0, "float32")
        return json.dumps(
            {
                "groups": [[g.storage.to_json(), g.rows, len(g.keys)] for g in self._groups],
                "lp": self._lp,
                "idx": self._written,
                "cap": self._cap,
                "codecs": [c.to_json() for c in self._codecs],
                "shape": [heads, kdim, vdim, dtype],
            }
        )

    @meta_state.setter
    def meta_state(self, v: str) -> None:
        meta = json.loads(v)
        arrays = getattr(self, "_state_arrays", [])
        self._lp = meta["lp"]
        self._written, self._cap = meta["idx"], meta["cap"]
        self._codecs = [KVCodec.from_json(c) for c in meta["codecs"]]
        heads, kdim, vdim, dtype = meta["shape"]
        self._shape = (heads, kdim, vdim, dtype) if heads else None
        self._groups, at = [], 0
        for storage, rows, n in meta["groups"]:
            planes = arrays[at : at + 2 * n]
            self._groups.append(
                PlaneGroup(Storage.from_json(storage), rows, planes[:n], planes[n:])
            )
            at += 2 * n
        self.offset, self.left_padding = arrays[at], arrays[at + 1]
        self._right_padding_to_roll = None
        self._waiting = None

    @classmethod
    def from_state(cls: type[S], state: Any, meta_state: str = "") -> S:
        cache = cls.__new__(cls)
        cache.state = state
        cache.meta_state = meta_state
        return cache
