"""Prefix reuse for caches that cannot be trimmed: one snapshot per prompt, at its last block
boundary, taken while it is prefilled (MLX thread).

Recurrent state (ArraysCache) and a sliding window the prompt wraps cannot be cut back to an
earlier position, so what a prompt's caches hold after its first token serves no other prompt
(prefix_reuse.save keeps none of it). Instead, a row whose prompt reaches at least one block
past where it starts (its prefix hit, or 0) is prefilled alone up to the prompt's last block
boundary k <= len - 1, tokens the batch would have prefilled anyway; that state is kept as an
exact record (local tier and store, `trimmable=False`: it serves length k only), and the row
goes on from it, feeding prompt[k:]. The same prompt again, or a next chat turn extending it,
finds the record at k.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import CacheList, RotatingKVCache, make_prompt_cache

from engine_service.checkpoints.prefix_cache import BLOCK_SIZE
from engine_service.checkpoints.prefix_reuse import PrefixReuse
from engine_service.model.mlx_compat import ring_position, set_ring_position
from engine_service.protocol.requests import GenerationRequest


def boundary(prompt_tokens: int, start: int) -> int:
    """Where a prompt's snapshot is taken: its last block boundary short of its last token
    (one token must be fed), when that is at least a block past `start`; 0: none."""
    k = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    return k if k >= start + BLOCK_SIZE else 0


def trimmable_at(cache: Any, tokens: int) -> bool:
    """Whether a layer of this kind holding `tokens` positions could be trimmed back."""
    if isinstance(cache, CacheList):
        return all(trimmable_at(c, tokens) for c in cache.caches)
    if isinstance(cache, RotatingKVCache):
        return tokens < int(cache.max_size)  # a window that has wrapped lost its oldest positions
    return bool(cache.is_trimmable())


def keep_window(caches: list[Any]) -> None:
    """Cuts each plain sliding window to its last max_size positions: a multi-token call
    leaves all of them in temporal order, though only the window is ever read again (the
    batch takes the last max_size; the next call keeps max_size - 1)."""
    for cache in caches:
        if not isinstance(cache, RotatingKVCache) or cache.keep:
            continue
        keys, values, size = cache.keys, cache.values, cache.max_size
        if keys is None or values is None:
            continue
        if keys.shape[2] > size and ring_position(cache) == keys.shape[2]:  # in temporal order
            cache.keys, cache.values = keys[..., -size:, :], values[..., -size:, :]
            set_ring_position(cache, size)


class PrefixSnapshots:
    def __init__(self, model: Any, prefixes: PrefixReuse, prefill_step: int) -> None:
        self.model = model
        self.prefixes = prefixes
        self.prefill_step = prefill_step
        self._kinds: list[Any] | None = None  # the model's empty caches, one per layer

    def due(self, request: GenerationRequest, start: int) -> int:
        """The block boundary to snapshot a fresh prompt at, starting from `start` cached
        tokens; 0 when its caches could be trimmed after its first token (the prompt's
        prefix is saved then) or it reaches no block past `start`."""
        if request.num_draft or request.kv.quantized:
            # The speculative lane prefills from the reused length itself; quantized rows
            # prefill in their codec inside the batch, not as the plain solo caches here.
            return 0
        k = boundary(len(request.prompt), start)
        if not k:
            return 0
        if self._kinds is None:
            self._kinds = make_prompt_cache(self.model)
        tokens = len(request.prompt) + 1  # what the caches hold after the first token
        return 0 if all(trimmable_at(c, tokens) for c in self._kinds) else k

    def take(
        self, request: GenerationRequest, caches: list[Any] | None, start: int, k: int
    ) -> list[Any]:
        """Prefills prompt[start:k] over `caches` (None: fresh), keeps that state as the
        prompt's exact prefix record, and returns the caches the row goes on from."""
        caches = caches if caches is not None else make_prompt_cache(self.model)
        prompt = request.prompt
        for at in range(start, k, self.prefill_step):
            self.model(mx.array(prompt[at : min(at + self.prefill_step, k)])[None], cache=caches)
            mx.eval([c.state for c in caches])
        keep_window(caches)
        self.prefixes.saves.save_exact(
            caches, prompt[:k], request.namespace, request.layout, request.prefix_record
        )
        return caches
