"""Training one embedded model from scratch: mlx-lm's own model class for its config, AdamW
with warm-up and cosine decay (mlx.optimizers), seeded windows of the token stream.

Written here rather than with mlx-lm's tuner (`mlx_lm.tuner.trainer`): that trainer is built
around fine-tuning datasets of prompts and completions and LoRA adapters; pre-training from
random weights on one token stream is a short loop over the same mlx primitives.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from engine_service.model.default_model import CONFIGS, SEED, VOCAB_SIZE
from engine_service.model.mlx_compat import model_classes
from training import fast_ops


@dataclass(frozen=True)
class Recipe:
    model: str = "tandem-tiny"
    steps: int = 1200
    batch: int = 32
    context: int = 256
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = SEED
    eval_windows: int = 64


@dataclass(frozen=True)
class Report:
    recipe: Recipe
    corpus_digest: str
    train_tokens: int
    tokens_seen: int
    train_loss: float  # mean over the last 50 steps
    held_out_loss: float
    held_out_perplexity: float
    seconds: float
    python: str
    mlx: str
    device: str
    ranks: int = 1  # data-parallel processes (training/ranks.py)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def build_model(name: str) -> tuple[Any, dict[str, Any]]:
    config = {**CONFIGS[name], "vocab_size": VOCAB_SIZE}
    model_class, args_class = model_classes(config)
    return model_class(args_class.from_dict(config)), config


def windows(stream: np.ndarray, starts: np.ndarray, context: int) -> mx.array:
    return mx.array(np.stack([stream[s : s + context + 1] for s in starts]))


@mx.custom_function
def _cross_entropy(logits: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
    """Per-token cross-entropy, and the probabilities its gradient needs.

    By hand rather than `nn.losses.cross_entropy` for the CPU: MLX's CPU `exp` is slow
    (training/fast_ops.py), and the library's loss takes the exp of the 32 x 256 x 2,048
    logits again in its backward pass. Keeping the forward pass's probabilities saves that
    pass: a tenth of a training step on 2 cores.
    """
    peak = mx.stop_gradient(logits.max(axis=-1, keepdims=True))
    exps = fast_ops.exp(logits - peak)
    total = exps.sum(axis=-1, keepdims=True)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)
    return (mx.log(total) + peak - picked).squeeze(-1), exps / total


@_cross_entropy.vjp
def _cross_entropy_vjp(
    primals: tuple[mx.array, mx.array], cotangents: Any, outputs: tuple[mx.array, mx.array]
) -> tuple[mx.array, mx.array]:
    logits, targets = primals
    one_hot = mx.arange(logits.shape[-1]) == targets[..., None]
    return (outputs[1] - one_hot) * cotangents[0][..., None], mx.zeros_like(targets)


def loss_of(model: Any, batch: mx.array) -> mx.array:
    logits = model(batch[:, :-1])
    losses: Any = _cross_entropy(logits.astype(mx.float32), batch[:, 1:])
    mean: mx.array = losses[0].mean()
    return mean


def _averaged(grads: Any, loss: mx.array, group: Any) -> tuple[Any, mx.array]:
    """The ranks' gradients and losses averaged: one all-sum of one flat vector (one
    message per step rather than one per parameter)."""
    flat: list[tuple[str, mx.array]] = tree_flatten(grads)  # type: ignore[assignment]
    vector = mx.concatenate([loss.reshape(1)] + [g.reshape(-1) for _, g in flat])
    vector = mx.distributed.all_sum(vector, group=group) / group.size()
    pieces, offset = [], 1
    for key, g in flat:
        pieces.append((key, vector[offset : offset + g.size].reshape(g.shape)))
        offset += g.size
    return tree_unflatten(pieces), vector[0]


def evaluate(model: Any, stream: np.ndarray, recipe: Recipe) -> float:
    """Mean cross-entropy over evenly spaced held-out windows (the same ones every time)."""
    last = len(stream) - recipe.context - 1
    starts = np.linspace(0, last, recipe.eval_windows).astype(np.int64)
    losses = [
        loss_of(model, windows(stream, starts[i : i + 16], recipe.context)).item()
        for i in range(0, len(starts), 16)
    ]
    return float(np.mean(losses))


def train(
    recipe: Recipe,
    train_stream: np.ndarray,
    held_out: np.ndarray,
    log: Any = print,
    group: Any = None,
    cpu_ops: bool = True,
) -> tuple[Any, dict[str, Any], float, float]:
    """The trained model, its config, the mean loss of its last 50 steps and its held-out
    loss. On a CPU, with the ops of training/fast_ops.py unless `cpu_ops` is False (the
    plain loop of bench/train_step_bench.py).

    With a distributed `group` of N ranks (training/ranks.py), every rank draws the same
    windows and takes every Nth of them; gradients are averaged, so the step is the same
    full batch's step, summed in another order.
    """
    ops = fast_ops.installed_for(mx.default_device()) if cpu_ops else nullcontext()
    with ops:
        return _train(recipe, train_stream, held_out, log, group)


def _train(
    recipe: Recipe, train_stream: np.ndarray, held_out: np.ndarray, log: Any, group: Any
) -> tuple[Any, dict[str, Any], float, float]:
    ranks = 1 if group is None else group.size()
    rank = 0 if group is None else group.rank()
    if recipe.batch % ranks:
        raise ValueError(f"a batch of {recipe.batch} does not split over {ranks} ranks")
    mx.random.seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    model, config = build_model(recipe.model)
    decay = optim.cosine_decay(recipe.learning_rate, recipe.steps, recipe.learning_rate / 10)
    warmup = optim.linear_schedule(0.0, recipe.learning_rate, recipe.warmup_steps)
    schedule = optim.join_schedules([warmup, decay], [recipe.warmup_steps])
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=recipe.weight_decay)
    state = [model.state, optimizer.state]

    loss_and_grad: Any = nn.value_and_grad(model, loss_of)  # type: ignore[attr-defined]

    def step(batch: mx.array) -> Any:
        loss, grads = loss_and_grad(model, batch)
        if ranks > 1:
            grads, loss = _averaged(grads, loss, group)
        grads, _ = optim.clip_grad_norm(grads, recipe.clip_norm)  # type: ignore[no-untyped-call]
        optimizer.update(model, grads)
        return loss

    compiled = mx.compile(step, inputs=state, outputs=state)
    recent: list[float] = []
    last = len(train_stream) - recipe.context - 1
    for k in range(recipe.steps):
        starts = rng.integers(0, last, recipe.batch)[rank::ranks]
        loss = compiled(windows(train_stream, starts, recipe.context))
        mx.eval(state)
        recent = [*recent[-49:], float(loss.item())]
        if k % 100 == 0 or k == recipe.steps - 1:
            log(f"step {k:5d}  loss {np.mean(recent):.3f}")
    held = evaluate(model, held_out, recipe)
    return model, config, float(np.mean(recent)), held


def save_weights(model: Any, path: Path) -> None:
    params: Any = tree_flatten(model.parameters())
    weights = {k: v.astype(mx.float16) for k, v in params}
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def environment() -> tuple[str, str, str]:
    return (
        platform.python_version(),
        str(getattr(mx, "__version__", "?")),
        str(mx.default_device()),
    )


def elapsed_since(start: float) -> float:
    return round(time.monotonic() - start, 1)


if __name__ == "__main__":  # pragma: no cover - use `python -m training`
    sys.exit("run `python -m training`")
