"""Reproducible per-request sampling.

Step t of a request samples with a PRNG key derived from (seed, t), never from MLX's
global random state, so the same request with the same seed gives the same tokens alone,
in any batch, and after a resume that restarts at step t. mlx-lm's BatchGenerator takes one
sampler per row (a callable on that row's logprobs); ours count their own steps, which
line up with generated-token indices because the batch samples each row once per step.
The filters are mlx-lm's (top-k, top-p, min-p); only the keyed draw is ours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from engine_service.protocol.sampling_options import SamplingOptions

Sampler = Callable[[mx.array], mx.array]
_MASK64 = (1 << 64) - 1


def step_key(seed: int, step: int) -> mx.array:
    """The PRNG key of one step: splitmix64 of (seed, step), as an MLX key."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return mx.random.key(x)


@mx.compile
def _keyed_draw(logprobs: mx.array, key: mx.array, inv_temp: mx.array) -> mx.array:
    """Gumbel-max: argmax(logprobs / T + Gumbel noise) is a categorical draw at temperature T.

    Compiled: BatchGenerator calls one sampler per row, and the eager version of these few
    ops cost ~3.5 ms per step at batch 16 here (vs 0.4 ms for mlx-lm's shared sampler);
    compiled, ~0.5 ms.
    """
    noise = mx.random.gumbel(shape=logprobs.shape, key=key)
    return mx.argmax(logprobs * inv_temp + noise, axis=-1)


class SeededSampler:
    """Samples one row: filters, then a categorical draw keyed by (seed, step)."""

    def __init__(self, options: SamplingOptions, start_step: int = 0) -> None:
        self.options = options
        self.step = start_step
        self._inv_temp = mx.array(1.0 / options.temperature, dtype=mx.float32)

    def __call__(self, logprobs: mx.array) -> mx.array:
        o = self.options
        if 0.0 < o.top_p < 1.0:
            logprobs = apply_top_p(logprobs, o.top_p)
        if o.min_p > 0.0:
            logprobs = apply_min_p(logprobs, o.min_p)
        if o.top_k > 0 and o.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, o.top_k)
        key = step_key(o.seed, self.step)
        self.step += 1
        return _keyed_draw(logprobs, key, self._inv_temp)


def make_sampler(options: SamplingOptions, start_step: int = 0) -> Sampler | None:
    """None means greedy: the batch's shared argmax (one batched call for all such rows)."""
    if options.greedy:
        return None
    return SeededSampler(options, start_step)


def make_processors(options: SamplingOptions) -> list[Callable[[mx.array, mx.array], mx.array]]:
    """mlx-lm's processors for the request's logit bias and penalties (none when all off)."""
    context = options.repetition_context_size or 20
    repetition = options.repetition_penalty
    return make_logits_processors(
        logit_bias=dict(options.logit_bias) or None,
        repetition_penalty=None if repetition in (0.0, 1.0) else repetition,
        repetition_context_size=context,
        presence_penalty=options.presence_penalty or None,
        presence_context_size=context,
        frequency_penalty=options.frequency_penalty or None,
        frequency_context_size=context,
    )


def token_logprobs(
    logprobs: mx.array, token: int, top_n: int
) -> tuple[float, list[tuple[int, float]]]:
    """The token's logprob and the top_n alternatives (best first) from one position's
    logprobs over the vocabulary."""
    top: list[tuple[int, float]] = []
    if top_n > 0:
        ids = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
        values = logprobs[ids]
        order = mx.argsort(-values)
        top_ids: Any = ids[order].tolist()
        top_values: Any = values[order].tolist()
        top = [(int(i), float(v)) for i, v in zip(top_ids, top_values, strict=True)]
    chosen: Any = logprobs[token].item()
    return float(chosen), top


def requested_logprobs(
    logprobs: mx.array, token: int, top_n: int
) -> tuple[float | None, list[tuple[int, float]] | None]:
    """token_logprobs for a request that asked (top_n >= 0), else (None, None)."""
    if top_n < 0:
        return None, None
    return token_logprobs(logprobs, token, top_n)
