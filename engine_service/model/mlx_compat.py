"""The private parts of mlx-lm the engine needs, in one place.

Pinned to mlx-lm 0.32.2 (pyproject.toml): these names carry a leading underscore upstream and
may move in any release, so every use goes through here and a version bump is checked here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_lm.models import cache as _cache
from mlx_lm.utils import _download, _get_classes

# The base of mlx-lm's cache classes: a batch cache of our own (kv/batch_cache.py) must be one
# for mlx-lm's model code and BatchGenerator to treat it as a cache.
BaseCache = _cache._BaseCache


def download(repo_id: str) -> Path:
    """A hub model's local directory, fetched by mlx-lm's own loader (no public wrapper
    returns the path without loading the weights)."""
    return Path(_download(repo_id))


def model_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's (Model, ModelArgs) classes for a config's model_type."""
    return _get_classes(config)  # type: ignore[no-any-return]


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper (llguidance builds its
    token table from it; the wrapper exposes it only as `_tokenizer`)."""
    return tokenizer._tokenizer


def ring_position(cache: Any) -> int:
    """A RotatingKVCache's write position `_idx` (the columns it holds until it wraps): its
    `offset` counts tokens seen, and no public name carries where the ring writes next."""
    return int(cache._idx)


def set_ring_position(cache: Any, position: int) -> None:
    """Sets a RotatingKVCache's write position `_idx` (a ring adopted or cut from a batch with
    its planes set directly: mlx-lm's constructor starts it at 0)."""
    cache._idx = position


def ring_in_temporal_order(cache: Any, plane: Any) -> Any:
    """A RotatingKVCache's plane (keys or values) in temporal order: mlx-lm's own unrolling
    `_temporal_order`, which BatchRotatingKVCache.merge uses the same way."""
    return cache._temporal_order(plane)


def running_batch(bg: Any) -> Any:
    """The BatchGenerator's batch of decoding rows (None when none): its `uids` and
    `prompt_cache` (one batch cache per layer)."""
    return bg._generation_batch


def pending_tokens(bg: Any, uids: list[int]) -> dict[int, int]:
    """The tokens the running batch sampled for these rows and feeds at its next step (the
    look-ahead `GenerationBatch` computes with each step); evaluating them waits for it."""
    batch = running_batch(bg)
    if batch is None or batch._next_tokens is None:
        return {}
    where = {uid: i for i, uid in enumerate(batch.uids)}
    rows = [where[u] for u in uids if u in where]
    if not rows:
        return {}
    tokens = batch._next_tokens.tolist()
    return {batch.uids[i]: int(tokens[i]) for i in rows}


def pending_logprobs(bg: Any, uids: list[int]) -> dict[int, Any]:
    """The log-probabilities (over the vocabulary) the running batch sampled the pending
    tokens of these rows from (pending_tokens)."""
    batch = running_batch(bg)
    if batch is None or batch._next_logprobs is None:
        return {}
    return {uid: batch._next_logprobs[i] for i, uid in enumerate(batch.uids) if uid in uids}


def batch_cache_bytes(bg: Any) -> int:
    """Bytes the running batch's layer caches hold (a cache kind without `nbytes` counts 0)."""
    batch = running_batch(bg)
    total = 0
    for cache in batch.prompt_cache if batch is not None else []:
        try:
            total += int(cache.nbytes)
        except NotImplementedError:
            pass
    return total
