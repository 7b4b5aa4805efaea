"""A compiled decode step: the model's one-token forward over the batch as one `mx.compile`d
graph, replayed each step instead of rebuilt in Python (--compiled-decode).

mlx-lm's batch caches write a step's keys at a Python-int column and return planes that grow
a column a step, so a traced graph would bake the first step's column in. Here the step runs
over `DecodeKV` stand-ins: the write column is an array (`mx.slice_update`), attention reads
the whole plane of the batch's capacity, and the mask (left padding, columns past the new
token) is computed from arrays. Attention reads the written columns rounded up to 32, so a
trace serves 32 steps of a (batch size, capacity, width) shape, then the next width traces.

It applies when every layer is a BatchQuantizedKVCache holding one plain group with nothing
to convert (decode_state), and the batch has at most max_batch rows; anything else (prefill,
packed or converting rows, other cache types, large batches) runs the model as it is. The
compiled step saves the Python that builds a step's graph: what bounds a small batch. A large
batch is bound by the device's step, and there (an H200, 32-128 rows of an 8B model) the
compiled step was slower than the eager one. No well-kept library compiles mlx-lm's decode
this way.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from engine_service.device_memory import is_out_of_memory
from engine_service.kv.batch_state import DecodeState

log = logging.getLogger(__name__)

WIDTH_STEP = 32


class DecodeKV:
    """A layer's cache inside the trace: array offsets, fixed-capacity planes."""

    def __init__(self, state: DecodeState, column: mx.array, width: int) -> None:
        self.keys = state.keys
        self.values = state.values
        self.left_padding = state.left_padding
        self.offset = state.offset  # per row: tokens held, the RoPE position
        self.column = column  # where this step's token is written (all rows alike)
        self.written = column + 1  # columns holding keys after this step's write
        self.width = width  # columns attention reads: the written ones, rounded up

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.column, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.column, axes=(2,))
        self.offset = self.offset + 1
        return self.keys[..., : self.width, :], self.values[..., : self.width, :]

    def make_mask(self, n: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        columns = mx.arange(self.width)
        valid = (columns[None, :] >= self.left_padding[:, None]) & (columns[None, :] <= self.column)
        return valid[:, None, None, :]


class CompiledDecode:
    """The model as BatchGenerator calls it, with its decode steps compiled."""

    def __init__(self, model: Any, max_batch: int | None = None) -> None:
        self.model = model
        self.max_batch = max_batch  # larger batches step eagerly; None: any batch
        self._step = mx.compile(self._forward)
        self.compiled_steps = 0  # for tests and stats
        self.enabled = True  # off after a compile failure: every later step runs eagerly
        self._checked: set[tuple[int, int, int]] = set()  # traces run once, by shape

    def __getattr__(self, name: str) -> Any:  # layers, make_cache, args...: the model's
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> Any:
        states = self._states(inputs, cache, kwargs) if self.enabled else None
        if states is None:
            return self.model(inputs, cache=cache, **kwargs)
        assert cache is not None
        at = states[0].column
        column = mx.array([at], dtype=mx.int32)
        # Attention reads the written columns rounded up to WIDTH_STEP: a trace per width (its
        # shape is an input), instead of reading the whole capacity every step.
        width = mx.zeros((min(-(-(at + 1) // WIDTH_STEP) * WIDTH_STEP, states[0].keys.shape[2]),))
        flat = [a for s in states for a in (s.keys, s.values, s.offset, s.left_padding)]
        shape = (inputs.shape[0], states[0].keys.shape[2], width.shape[0])
        try:
            logits, *planes = self._step(inputs, column, width, *flat)
            if shape not in self._checked:  # a new trace: run it now, where failure is caught
                mx.eval(logits, *planes)
                self._checked.add(shape)
        except Exception as exc:  # noqa: BLE001 - a graph MLX cannot compile: caches untouched
            if is_out_of_memory(exc):  # the device's state, not the graph: the step failed
                raise
            log.exception("the compiled decode step failed; decoding eagerly from now on")
            self.enabled = False
            return self.model(inputs, cache=cache, **kwargs)
        for layer, (keys, values, offset) in zip(cache, _triples(planes), strict=True):
            layer.adopt_decode(keys, values, offset)
        self.compiled_steps += 1
        return logits

    def _states(
        self, inputs: mx.array, cache: Any, kwargs: dict[str, Any]
    ) -> list[DecodeState] | None:
        """Each layer's decode state when this is a one-token step they all allow."""
        if kwargs or not cache or inputs.ndim != 2 or inputs.shape[1] != 1:
            return None
        if self.max_batch is not None and inputs.shape[0] > self.max_batch:
            return None
        states: list[DecodeState] = []
        for layer in cache:
            state = getattr(layer, "decode_state", lambda: None)()
            if state is None:
                return None
            states.append(state)
        if len({s.column for s in states}) != 1:
            return None
        return states

    def _forward(
        self, inputs: mx.array, column: mx.array, width: mx.array, *flat: mx.array
    ) -> list[mx.array]:
        layers = [
            DecodeKV(
                DecodeState(flat[i], flat[i + 1], flat[i + 2], flat[i + 3], 0),
                column,
                width.shape[0],
            )
            for i in range(0, len(flat), 4)
        ]
        logits = self.model(inputs, cache=layers)
        out = [logits]
        for layer in layers:
            out += [layer.keys, layer.values, layer.offset]
        return out


def _triples(planes: list[mx.array]) -> list[tuple[mx.array, mx.array, mx.array]]:
    return [(planes[i], planes[i + 1], planes[i + 2]) for i in range(0, len(planes), 3)]
