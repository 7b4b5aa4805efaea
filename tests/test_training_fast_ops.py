"""The trainer's CPU ops (training/fast_ops.py) compute what mlx-lm's own ops compute: the
same loss and gradients, to float32 rounding, on the trained models' architectures."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from training import fast_ops
from training.train import build_model, loss_of


def _loss_and_grads(name: str, batch: mx.array, fast: bool) -> tuple[float, dict[str, Any]]:
    mx.random.seed(3)
    model, _ = build_model(name)
    value_and_grad: Any = nn.value_and_grad(model, loss_of)  # type: ignore[attr-defined]
    if fast:
        with fast_ops.installed_for(mx.cpu):
            loss, grads = value_and_grad(model, batch)
            mx.eval(loss, grads)
    else:
        loss, grads = value_and_grad(model, batch)
    return loss.item(), dict(tree_flatten(grads))


@pytest.mark.parametrize("name", ["tandem-tiny", "tandem-tiny-hybrid"])
def test_fast_ops_give_the_library_ops_loss_and_gradients(name: str) -> None:
    rng = np.random.default_rng(5)
    # 300 tokens: three query blocks, the last one short.
    batch = mx.array(rng.integers(3, 2048, (2, 301)))
    library_loss, library_grads = _loss_and_grads(name, batch, fast=False)
    fast_loss, fast_grads = _loss_and_grads(name, batch, fast=True)
    assert fast_loss == pytest.approx(library_loss, rel=1e-5)
    assert library_grads.keys() == fast_grads.keys()
    for key, expected in library_grads.items():
        got = np.array(fast_grads[key])
        scale = float(np.abs(np.array(expected)).max()) or 1.0
        assert np.abs(got - np.array(expected)).max() <= 1e-4 * scale, key


def test_fast_exp_and_swiglu_match_mlx() -> None:
    x = mx.linspace(-30, 30, 10_001)
    assert np.allclose(np.array(fast_ops.exp(x)), np.array(mx.exp(x)), rtol=1e-6, atol=0)
    gate, value = mx.linspace(-20, 20, 4_001), mx.linspace(1, 2, 4_001)
    assert np.allclose(
        np.array(fast_ops.swiglu(gate, value)), np.array(gate * mx.sigmoid(gate) * value), rtol=1e-5
    )


def test_the_library_ops_return_when_training_ends() -> None:
    from mlx_lm.models import llama

    def attention() -> Any:
        return getattr(llama, "scaled_dot_product_attention")  # noqa: B009 - not exported

    before = attention()
    with fast_ops.installed_for(mx.cpu):
        assert attention() is fast_ops.causal_attention
    assert attention() is before
    with fast_ops.installed_for(mx.Device(mx.gpu)):
        assert attention() is before
