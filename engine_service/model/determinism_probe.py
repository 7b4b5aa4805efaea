"""Deterministic mode's start-up probe (model/deterministic.py has the mode): what it cannot
guarantee is refused before the engine serves, on the device it serves on.

The mode makes what it knows of batch-invariant (projections, attention); the probe checks
the rest of the forward pass. A probe row's logits over a few decode steps must be the same
bits alone and as the last of eight rows of other lengths (a place where a kernel that treats
rows by their place in a block, OpenBLAS's panels, gives other bits than at the first), and
the compiled decode step (loop/compiled_decode.py) must give the eager step's bits, or it is
left off: steps of a row switch between the two with what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine_service.kv.batch_cache import adopt_row
from engine_service.model.deterministic import DeterministicModel
from engine_service.protocol.kv_codec import KVCodec

PROBE_STEPS = 4  # the first after the rows merge grows the planes eagerly; later ones compile
_TARGET = [5, 9, 14, 3, 8, 21, 6]
_OTHERS = [[4 + i + j for j in range(3 + 2 * i)] for i in range(7)]


class NotRowInvariant(ValueError):
    """Deterministic mode cannot hold for this model on this device: it is refused at
    start-up."""


def check_row_invariant(
    model: Any,
    rows: int = 0,
    compiled: Callable[[Any], Any] | None = None,
    matmul_kernel: bool = False,
    rows_alone: bool | None = None,
) -> bool:
    """Raises NotRowInvariant unless every layer's cache is mlx-lm's plain KVCache (the row
    attention of kv/row_attention.py reads all of a row's keys, so windows and recurrent
    states are out of its reach) and the probe row's logits are the same bits alone and
    beside seven others (what else the forward pass does: mixture-of-experts layers, for one,
    group a batch's tokens by expert). Returns whether `compiled` (a compiled decode step
    around the deterministic model) gives those bits too, alone and beside the others (False
    for a model whose rows attend alone: it steps eagerly)."""
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)} - {"KVCache"})
    if kinds:
        raise NotRowInvariant(
            f"--deterministic needs a plain KV cache in every layer; this model keeps "
            f"{', '.join(kinds)}"
        )
    eager = DeterministicModel(model, rows, matmul_kernel, rows_alone)
    alone = _probe_logits(eager, [_TARGET])
    if not _same(alone, _probe_logits(eager, [*_OTHERS, _TARGET])):
        raise NotRowInvariant(
            "--deterministic: this model's rows are not batch-invariant (a probe row's logits "
            "differ alone and beside others: mixture-of-experts routing or attention that "
            "does not go through mlx-lm's scaled_dot_product_attention)"
        )
    if compiled is None or not eager.compiles:
        return False
    step = compiled(eager)
    agree = _same(alone, _probe_logits(step, [_TARGET]))
    agree = agree and _same(alone, _probe_logits(step, [*_OTHERS, _TARGET]))
    return bool(agree and step.compiled_steps > 0 and step.enabled)


def _same(alone: list[mx.array], batched: list[mx.array]) -> bool:
    """The target's logits (the last row) equal, step by step."""
    return all(mx.array_equal(a[-1], b[-1]).item() for a, b in zip(alone, batched, strict=True))


def _probe_logits(model: Any, prompts: list[list[int]]) -> list[mx.array]:
    """Each row prefilled alone into the engine's batch rows (kv/batch_cache.py), the rows
    merged into one batch, PROBE_STEPS greedy decode steps: each step's logits (rows, vocab)."""
    per_row = []
    for prompt in prompts:
        caches = [adopt_row(c, KVCodec()) for c in make_prompt_cache(model.model)]
        model(mx.array([prompt[:-1]]), cache=caches)
        per_row.append(caches)
    batch = [per_row[0][i].merge([c[i] for c in per_row]) for i in range(len(per_row[0]))]
    tokens = mx.array([[p[-1]] for p in prompts])
    steps = []
    for _ in range(PROBE_STEPS):
        logits = model(tokens, cache=batch)[:, -1]
        mx.eval(logits)
        steps.append(logits)
        tokens = mx.argmax(logits, axis=-1)[:, None]
    return steps
