"""Where raw mlx-lm's time to first token over a long cached prefix goes (issue 37: on the H200
its 16-token turn after 32k cached positions of the 0.6B shape took 133 ms, where reading
the cache once is ~1 ms).

Three ways to the first token from the same cache (deep copies), interleaved (ABCABC...),
the first round dropped:
A: mlx-lm's BatchGenerator, as bench/hit_floor_bench.py's raw side times it;
B: the same with `mx.clear_cache` a no-op (mlx-lm's prompt pass empties MLX's buffer cache
   after each chunk, so the next step allocates afresh: on CUDA, cudaMalloc);
C: the model itself: one forward pass over the 16 tokens, then the argmax;
D: the same pass over mlx-lm's BatchKVCache merged from the cache (an array mask, not
   "causal"); E: that merge alone;
F: A with the device pool keeping freed memory mapped (bench/device_pool.py; the
   pool is filled by an untimed run first and trimmed after, so A starts from CUDA's default).

    python bench/step_floor_probe.py [--model qwen3-0.6b-shape] [--prefix 32768] [--turn 16]
        [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
# isort: on

from mlx_lm.generate import BatchGenerator  # noqa: E402

from bench.device_pool import DevicePool, default_keep_bytes  # noqa: E402
from bench.folded_prefill_bench import prefilled  # noqa: E402
from bench.shapes import load_shape  # noqa: E402


def generator(model: Any, turn: list[int], cache: list[Any]) -> None:
    bg = BatchGenerator(model, stop_tokens=set())
    bg.insert([turn], max_tokens=[1], caches=[cache])
    while not bg.next()[1]:
        pass
    bg.close()


def without_clear_cache(model: Any, turn: list[int], cache: list[Any]) -> None:
    clear, mx.clear_cache = mx.clear_cache, lambda: None  # type: ignore[assignment]
    try:
        generator(model, turn, cache)
    finally:
        mx.clear_cache = clear  # type: ignore[assignment]


def bare(model: Any, turn: list[int], cache: list[Any]) -> None:
    logits = model(mx.array([turn]), cache=cache)
    mx.eval(mx.argmax(logits[:, -1], axis=-1))


def over_batch_cache(model: Any, turn: list[int], cache: list[Any]) -> None:
    """The same pass over mlx-lm's batch caches merged from the row's (its array mask)."""
    batch = [c.merge([c]) for c in cache]
    logits = model(mx.array([turn]), cache=batch)
    mx.eval(mx.argmax(logits[:, -1], axis=-1))


def merged_only(model: Any, turn: list[int], cache: list[Any]) -> None:
    """Only the merge into mlx-lm's batch caches, evaluated."""
    batch = [c.merge([c]) for c in cache]
    mx.eval([c.state for c in batch])


class KeptPool:
    """Way F's set-up: the default pool keeps freed memory, filled by one untimed run."""

    def __init__(self) -> None:
        self.cuda = DevicePool.load() if mx.cuda.is_available() else None

    def before(self, model: Any, turn: list[int], prefix: list[Any]) -> None:
        if self.cuda is not None:
            self.cuda.keep_freed(default_keep_bytes())
        generator(model, turn, [copy.deepcopy(c) for c in prefix])

    def after(self) -> None:
        if self.cuda is not None:
            self.cuda.keep_freed(0)
            self.cuda.trim()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b-shape")
    ap.add_argument("--prefix", type=int, default=32768)
    ap.add_argument("--turn", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    loaded = load_shape(args.model)
    model, vocab = loaded.model, loaded.vocab_size
    rng = random.Random(0)
    prefix = prefilled(model, vocab, args.prefix, rng)
    ways: dict[str, Callable[[Any, list[int], list[Any]], None]] = {
        "A mlx-lm BatchGenerator": generator,
        "B the same, clear_cache a no-op": without_clear_cache,
        "C the model's forward pass": bare,
        "D the same over mlx-lm's batch caches, merged in": over_batch_cache,
        "E the merge alone": merged_only,
        "F A with the device pool kept": generator,
    }
    pool = KeptPool()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds + 1):
        turn = [rng.randrange(3, vocab - 1) for _ in range(args.turn)]
        for name, way in ways.items():
            cache = [copy.deepcopy(c) for c in prefix]
            mx.eval([c.state for c in cache])
            if name.startswith("F"):
                pool.before(model, turn, prefix)
            mx.synchronize()
            start = time.perf_counter()
            way(model, turn, cache)
            elapsed = time.perf_counter() - start
            if name.startswith("F"):
                pool.after()
            if r:
                times[name].append(elapsed)
    print(f"{args.model} on {mx.default_device()}, {args.turn} tokens after {args.prefix}:")
    base = times["A mlx-lm BatchGenerator"]
    for name, values in times.items():
        ratios = sorted(v / a for v, a in zip(values, base, strict=True))
        print(
            f"  {name}: {statistics.median(values) * 1e3:.1f} ms "
            f"(/ A: {statistics.median(ratios):.2f}, {ratios[0]:.2f}-{ratios[-1]:.2f})"
        )


if __name__ == "__main__":
    main()
