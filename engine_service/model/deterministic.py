"""Deterministic mode (--deterministic): a row's logits are bit-identical whether it runs alone
or in any batch, so a seeded or resumed generation does not depend on what ran beside it.

Where the bits of a row depended on its batch (bench/batch_invariance.py, docs/determinism.md):

- projections: a matmul's kernel (and so each row's reduction order) is chosen by the number
  of rows. Here every one-token-per-row matmul (a decode step) runs on blocks of exactly
  `rows` rows, zero-padded: the same kernel whatever the batch. Or, on MLX-CUDA when asked
  (--deterministic-matmul kernel), plain 16-bit ones go through one kernel whose arithmetic
  for a row does not depend on the row count (model/invariant_matmul_cuda.py);
- attention: in a batch a row's keys sit after its left padding, which shifts them inside the
  reduction blocks. Here each row attends over its own keys only: a decode step reduces each
  row's keys in chunks counted from its own first key (one kernel on MLX-CUDA,
  kv/row_attention_cuda.py; the same algorithm in MLX ops elsewhere, kv/row_attention.py) or,
  on the CPU, runs each row alone through SDPA (`rows_alone`: eager steps); a prefill chunk
  runs row by row with the padding sliced off;
- prefill: the engine prefills one row at a time, at fixed chunk boundaries from the row's
  start (BatchGenerator's prefill_batch_size 1), so a prompt's KV is the same however it was
  scheduled.

Norms, RoPE, embeddings and sampling are per row already. The compiled decode step
(loop/compiled_decode.py) can wrap a DeterministicModel: the paddings are then arrays; the
start-up probe (model/determinism_probe.py) checks it gives the eager step's bits. The
patches below act only inside a DeterministicModel call on the calling thread: other models
in the process are untouched.
mlx and mlx-lm have no batch-invariant mode (vLLM and SGLang have one, on their own kernels),
which is why this exists.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear

from engine_service.kv import attention_routing
from engine_service.kv.row_attention import (
    Paddings,
    active_matmul_kernel,
    active_rows,
    deterministic_call,
)
from engine_service.model.invariant_matmul_cuda import AVAILABLE as KERNEL_AVAILABLE
from engine_service.model.invariant_matmul_cuda import applies, invariant_matmul

# Rows per matmul block in a decode step: the batch is cut into blocks of this many (the last
# one zero-padded). On a GPU one block of 128 covers a batch of up to 128 in one call that
# reads the weights once, as the batch's own call would. On the CPU a row's bits may also
# depend on its place inside a block (OpenBLAS's kernels for some CPUs treat row panels
# differently): blocks of CPU_BLOCK_ROWS where every projection of the model gives a row the
# same bits at every place of such a block (checked at start: cpu_rows), else a call a row.
GPU_ROWS = 128
CPU_BLOCK_ROWS = 8
CPU_ROWS = 1


def default_rows(model: Any = None) -> int:
    if mx.default_device() != mx.cpu:
        return GPU_ROWS
    return CPU_ROWS if model is None else cpu_rows(model)


def cpu_rows(model: Any) -> int:
    """CPU_BLOCK_ROWS when each of the model's distinct projections gives a probe row the
    same bits at every place of a block of that many rows, beside random rows, as alone among
    zero rows; else CPU_ROWS (the start-up probe checks the whole model again after)."""
    if not hasattr(model, "named_modules"):  # not an mlx module: nothing is known of it
        return CPU_ROWS
    projections = _projections(model)
    return CPU_BLOCK_ROWS if all(_keeps_rows(p, CPU_BLOCK_ROWS) for p in projections) else CPU_ROWS


def _projections(model: Any) -> list[Callable[[mx.array], mx.array]]:
    """One call per distinct projection kind and weight shape: Linear, QuantizedLinear and a
    tied embedding's as_linear, as a decode step calls them."""
    found: dict[tuple[Any, ...], Callable[[mx.array], mx.array]] = {}
    for _, module in model.named_modules():
        weight = module.get("weight") if hasattr(module, "get") else None
        if weight is None:
            continue
        kind = (type(module).__name__, tuple(weight.shape), weight.dtype)
        if isinstance(module, Linear | QuantizedLinear):
            found.setdefault(kind, module)
        elif isinstance(module, Embedding | QuantizedEmbedding):
            found.setdefault(kind, module.as_linear)
    return list(found.values())


def _keeps_rows(project: Callable[[mx.array], mx.array], rows: int) -> bool:
    """Whether a probe row's output is the same bits at each place of a block of `rows` rows
    as alone (the block's other rows zero)."""
    width, dtype = _input_of(project)
    probe = mx.random.normal((1, 1, width), dtype, key=mx.random.key(7))
    others = mx.random.normal((rows, 1, width), dtype, key=mx.random.key(8))
    alone = project(mx.concatenate([probe, mx.zeros((rows - 1, 1, width), dtype)]))[0]
    for place in range(rows):
        block = mx.concatenate([others[:place], probe, others[place + 1 :]])
        if not mx.array_equal(project(block)[place], alone).item():
            return False
    return True


def _input_of(project: Any) -> tuple[int, mx.Dtype]:
    """The width and dtype of what a decode step feeds this projection."""
    layer = getattr(project, "__self__", project)  # as_linear: its embedding
    weight = layer["weight"]
    if isinstance(layer, QuantizedLinear | QuantizedEmbedding):
        return int(weight.shape[-1] * 32 // layer.bits), layer["scales"].dtype
    return int(weight.shape[-1]), weight.dtype


def arithmetic(rows: int, kernel: bool, rows_alone: bool | None) -> str:
    """What fixes a deterministic engine's bits beyond its model, dtype, device kind and
    software versions: its checkpoints and prefixes carry it in their model id
    (checkpoints/generation_meta.py), so a generation resumes only under the same
    arithmetic, never under another that would go on with other bits."""
    matmul = "kernel" if kernel and KERNEL_AVAILABLE else "blocks"
    alone = rows_alone_by_default() if rows_alone is None else rows_alone
    return f"matmul {matmul}, rows {rows or 'default'}, attention {'alone' if alone else 'chunks'}"


def rows_alone_by_default() -> bool:
    """Whether a decode step's rows attend one at a time (eagerly) rather than through the
    chunked algorithm a compiled step can run: on the CPU, where the chunks in MLX ops cost
    the mode most of its throughput at 8-32 streams (docs/determinism.md)."""
    return bool(mx.default_device() == mx.cpu)


def _in_blocks(call: Callable[[mx.array], mx.array], x: mx.array, rows: int) -> mx.array:
    """call(x) for a one-token-per-row x (batch, 1, width), computed on blocks of exactly
    `rows` rows (zero rows pad the last one). Few ops: at small batches the step is bound by
    the ops Python issues, not by the padded rows' arithmetic."""
    batch = x.shape[0]
    if batch == rows:
        return call(x)
    short = -batch % rows
    padded = mx.pad(x, [(0, short), (0, 0), (0, 0)]) if short else x
    if padded.shape[0] == rows:
        return call(padded)[:batch]
    blocks = [call(padded[at : at + rows]) for at in range(0, padded.shape[0], rows)]
    return mx.concatenate(blocks)[:batch]


def _kernel_projection(layer: Any, x: mx.array) -> mx.array:
    """A Linear's (or a tied embedding's) x @ W.T (+ bias) through the batch-invariant kernel,
    x (batch, 1, K)."""
    batch, _, width = x.shape
    y = invariant_matmul(x.reshape(batch, width), layer.weight)
    if "bias" in layer:
        y = y + layer["bias"]
    return y.reshape(batch, 1, -1)


def _blocked(original: Callable[..., mx.array], plain: bool) -> Callable[..., mx.array]:
    """The projection inside a deterministic call: the invariant kernel for a plain 16-bit
    weight on MLX-CUDA when the call asks for it, else fixed row blocks."""

    def method(self: Any, x: mx.array) -> mx.array:
        rows = active_rows()
        if not rows or x.ndim != 3 or x.shape[1] != 1:
            return original(self, x)
        if plain and active_matmul_kernel() and applies(x, self.weight):
            return _kernel_projection(self, x)
        return _in_blocks(lambda block: original(self, block), x, rows)

    method.__wrapped__ = original  # type: ignore[attr-defined]
    return method


_installed = threading.Lock()
_PATCHED: list[tuple[type, str, bool]] = [  # class, method, whether its weight is plain
    (Linear, "__call__", True),
    (QuantizedLinear, "__call__", False),
    (Embedding, "as_linear", True),  # tied output projections
    (QuantizedEmbedding, "as_linear", False),
]


def _install() -> None:
    """Patches mlx's projection classes once (idempotent); they change only while a
    deterministic call runs on their thread."""
    with _installed:
        for cls, name, plain in _PATCHED:
            method = getattr(cls, name)
            if not hasattr(method, "__wrapped__"):
                setattr(cls, name, _blocked(method, plain))
        attention_routing.install()


def left_padding(cache: list[Any] | None, batch: int) -> Paddings:
    """Each row's left padding in a batch cache (mlx-lm's or ours); zeros without one. Inside
    a compiled step (a DecodeKV, loop/compiled_decode.py) the array itself."""
    layer = cache[0] if cache else None
    if hasattr(layer, "written"):
        return layer.left_padding  # type: ignore[union-attr,no-any-return]
    pads = getattr(layer, "row_paddings", None)  # BatchQuantizedKVCache's, no device read
    if pads is None and layer is not None and hasattr(layer, "left_padding"):
        pads = layer.left_padding.tolist()
    return list(pads) if pads is not None else [0] * batch


class DeterministicModel:
    """The model as BatchGenerator calls it, each call batch-invariant (module docstring)."""

    def __init__(
        self,
        model: Any,
        rows: int = 0,
        matmul_kernel: bool = False,
        rows_alone: bool | None = None,
    ) -> None:
        if rows < 0:
            raise ValueError("deterministic rows must be >= 1 (0: the default)")
        _install()
        self.model = model
        # matmul_kernel on MLX-CUDA: the invariant kernel for plain 16-bit projections (blocks
        # of `rows` for the others); else blocks of `rows` for all.
        self.matmul_kernel = matmul_kernel and KERNEL_AVAILABLE
        self.rows = rows or default_rows(model)
        # Decode attention a row at a time through SDPA (steps eager only, `compiles` False),
        # else the chunked algorithm, which compiles (None: rows_alone_by_default()).
        self.rows_alone = rows_alone_by_default() if rows_alone is None else rows_alone

    @property
    def compiles(self) -> bool:
        """Whether a compiled decode step (loop/compiled_decode.py) may wrap this model."""
        return not self.rows_alone

    def __getattr__(self, name: str) -> Any:  # layers, make_cache, args...: the model's
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> Any:
        pads = left_padding(cache, inputs.shape[0])
        with deterministic_call(self.rows, pads, self.matmul_kernel, self.rows_alone):
            return self.model(inputs, cache=cache, **kwargs)


def deterministic(model: Any, rows: int = 0) -> DeterministicModel:
    """The model, batch-invariant; rows: the decode matmul block (0: default_rows())."""
    return DeterministicModel(model, rows)
