"""Training on this machine's CPU: our trainer against the plain loop, interleaved (ABAB).

A: the plain mlx loop a user would write: one process, mlx's `nn.losses.cross_entropy`,
   BLAS on every core (the recipe of training/train.py otherwise).
B: `python -m training` as it runs by default on a CPU: two data-parallel ranks
   (training/ranks.py), the cross-entropy that keeps its probabilities, and the CPU ops of
   training/fast_ops.py (libm's exp, causal attention in query blocks).

Each run trains --steps steps of the same recipe from the same prepared token streams, then
evaluates (the same for both); its wall time is taken from outside. Prints each pair and the
median of the paired ratios A / B with their spread.

    python bench/train_step_bench.py [--model tandem-tiny] [--steps 40] [--pairs 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]


def library_worker(streams: Path, model: str, steps: int) -> None:
    """The plain loop: training/train.py's recipe with mlx's own cross-entropy and mlx-lm's
    own ops (not training/fast_ops.py's), one process."""
    # isort: off
    import engine_service  # noqa: F401  (the fast BLAS must load before mlx)

    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from training import train as trainer
    # isort: on

    def library_loss(model_: object, batch: mx.array) -> mx.array:
        logits = model_(batch[:, :-1])  # type: ignore[operator]
        loss: mx.array = nn.losses.cross_entropy(logits.astype(mx.float32), batch[:, 1:]).mean()
        return loss

    trainer.loss_of = library_loss  # type: ignore[assignment]
    data = np.load(streams / "streams.npz")
    recipe = replace(trainer.Recipe(), model=model, steps=steps)
    data_ids = data["train"].astype(np.int32), data["held_out"].astype(np.int32)
    trainer.train(recipe, *data_ids, cpu_ops=False)


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "library":
        library_worker(args.streams, args.model, args.steps)
        return
    with tempfile.TemporaryDirectory(prefix="tandem-train-bench-") as tmp:
        streams, out = Path(tmp) / "streams", Path(tmp) / "out"
        python = sys.executable
        subprocess.run(
            [python, "-m", "training", "--prepare", "--out", str(streams)],
            check=True,
            stdout=subprocess.DEVNULL,
            cwd=ROOT,
        )
        plain = [python, __file__, "--worker", "library", "--streams", str(streams)]
        plain += ["--model", args.model, "--steps", str(args.steps)]
        ours = [python, "-m", "training", "--streams", str(streams), "--out", str(out)]
        ours += ["--models", args.model, "--steps", str(args.steps)]
        ratios = []
        for pair in range(args.pairs):
            a, b = timed(plain), timed(ours)
            ratios.append(a / b)
            print(f"  pair {pair + 1}: plain loop {a:6.1f} s, ours {b:6.1f} s, {a / b:.2f}x")
    print(
        f"{args.model}, {args.steps} steps: ours is {statistics.median(ratios):.2f}x the plain "
        f"loop's speed (spread {min(ratios):.2f}-{max(ratios):.2f}, {args.pairs} pairs)"
    )


if __name__ == "__main__":
    main()
