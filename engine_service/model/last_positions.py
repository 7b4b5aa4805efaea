"""A forward pass whose logits are computed at chosen positions only.

A prompt chunk that ends a row's prompt gives the row's first token (loop: the folding
generator in model/mlx_compat.py), so the chunk's logits are needed at each such row's last
position, and nowhere else: the head over every position of a 2,048-token chunk of a
152k-token vocabulary would be ~0.3 TFLOP and 0.6 GB a row. mlx-lm's models have no
parameter for that, but nearly all share one shape: `out = self.model(...)` (the body), then
a head applied position by position (`lm_head`, tied embeddings, a soft cap). `LastPositions`
puts a stand-in for the body that returns only the chosen positions' hidden states, for one
call. A model it does not fit is found at start-up by `probe` (the stand-in's logits must
equal the full pass's at those positions), and then never folds.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import make_prompt_cache

log = logging.getLogger(__name__)


class _ChosenPositions:
    """The body, returning its hidden states at (row, position) pairs only: [pairs, 1, H]."""

    def __init__(self, body: Any, rows: list[int], positions: list[int]) -> None:
        self.body = body
        self.rows = mx.array(rows)
        self.positions = mx.array(positions)

    def __getattr__(self, name: str) -> Any:  # embed_tokens (tied heads), layers...
        return getattr(self.body, name)

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        hidden: mx.array = self.body(*args, **kwargs)
        return hidden[self.rows, self.positions][:, None, :]


def _host(model: Any) -> Module | None:
    """The module whose `model` child is the body: the model, or a wrapper's language model
    (the engine's wrappers around the model, BatchMasks and the like, hold it as `model`)."""
    while not isinstance(model, Module) and hasattr(model, "model"):
        model = model.model
    for host in (model, getattr(model, "language_model", None)):
        if isinstance(host, Module) and isinstance(host.get("model"), Module):
            return host
    return None


class LastPositions:
    """Installs the stand-in body on a model's host module for one call."""

    def __init__(self, host: Module) -> None:
        self.host = host

    @contextlib.contextmanager
    def only(self, rows: list[int], positions: list[int]) -> Iterator[None]:
        """Within: the model's logits are [len(rows), 1, vocab], row i's at positions[i]."""
        body = self.host["model"]
        # Module keeps children in its dict, and its __getattr__ reads them there.
        dict.__setitem__(self.host, "model", _ChosenPositions(body, rows, positions))
        try:
            yield
        finally:
            dict.__setitem__(self.host, "model", body)

    @classmethod
    def probe(cls, model: Any) -> LastPositions | None:
        """For this model, or None when it does not have the shape (module docstring): a
        two-row pass of a few tokens, its logits at chosen positions compared with the full
        pass's."""
        host = _host(model)
        if host is None:
            return None
        found = cls(host)
        tokens = mx.array([[5, 9, 13, 17], [21, 25, 29, 33]])
        try:
            full = model(tokens, cache=make_prompt_cache(model))
            with found.only([0, 1], [3, 1]):
                chosen = model(tokens, cache=make_prompt_cache(model))
            want = mx.stack([full[0, 3], full[1, 1]])[:, None, :].astype(mx.float32)
            # Another position's logits differ wholly; the same position's by rounding only
            # (the head runs over fewer rows: bf16 sums may round apart).
            scale = mx.abs(want).max()
            fits = chosen.shape == want.shape and bool(
                (mx.abs(chosen.astype(mx.float32) - want) <= 0.02 * scale).all().item()
            )
        except Exception as exc:  # noqa: BLE001 - any model code that cannot: no fold
            log.info("a prompt's first token takes a step of its own for this model: %s", exc)
            return None
        if not fits:
            log.info("a prompt's first token takes a step of its own for this model")
            return None
        return found
