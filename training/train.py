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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from engine_service.model.default_model import CONFIGS, SEED, VOCAB_SIZE
from engine_service.model.mlx_compat import model_classes


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

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def build_model(name: str) -> tuple[Any, dict[str, Any]]:
    config = {**CONFIGS[name], "vocab_size": VOCAB_SIZE}
    model_class, args_class = model_classes(config)
    return model_class(args_class.from_dict(config)), config


def windows(stream: np.ndarray, starts: np.ndarray, context: int) -> mx.array:
    return mx.array(np.stack([stream[s : s + context + 1] for s in starts]))


def loss_of(model: Any, batch: mx.array) -> mx.array:
    logits = model(batch[:, :-1])
    return nn.losses.cross_entropy(logits.astype(mx.float32), batch[:, 1:]).mean()


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
    recipe: Recipe, train_stream: np.ndarray, held_out: np.ndarray, log: Any = print
) -> tuple[Any, dict[str, Any], float, float]:
    """The trained model, its config, the mean loss of its last 50 steps and its held-out
    loss."""
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
        grads, _ = optim.clip_grad_norm(grads, recipe.clip_norm)  # type: ignore[no-untyped-call]
        optimizer.update(model, grads)
        return loss

    compiled = mx.compile(step, inputs=state, outputs=state)
    recent: list[float] = []
    last = len(train_stream) - recipe.context - 1
    for k in range(recipe.steps):
        starts = rng.integers(0, last, recipe.batch)
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
