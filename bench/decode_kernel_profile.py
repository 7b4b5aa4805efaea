"""Where a decode step's device time goes, kernel by kernel, on MLX-CUDA: the engine's default
step against deterministic mode's (issue 39), traced with CUPTI through torch's profiler (the
device image has torch; it records every kernel of the process, MLX's too).

For each side: wall time a step, device busy time a step (the sum of its kernels' durations),
and the kernels taking the most device time (calls a step, microseconds a call).

    python bench/decode_kernel_profile.py [--model llama3-8b-shape] [--streams 1] [--steps 16]
        [--kernel] [--top 12]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
# isort: on

from mlx_lm.generate import BatchGenerator  # noqa: E402

from bench.determinism_bench import COMPILED_MAX_BATCH, engine_side, row_caches  # noqa: E402
from bench.device_timing import profile_kernels  # noqa: E402
from bench.engine_bench import model_spec  # noqa: E402
from engine_service.loop.compiled_decode import CompiledDecode  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402


def profile_side(model: Any, prompts: list[list[int]], steps: int, top: int) -> None:
    bg = BatchGenerator(
        model, completion_batch_size=len(prompts), prefill_batch_size=8, stop_tokens=set()
    )
    bg.insert(prompts, max_tokens=[10_000] * len(prompts), caches=row_caches(model, prompts))
    while len(bg.next()[1]) < len(prompts):
        pass
    for _ in range(8):  # warm
        bg.next()
    wall = 0.0

    def run() -> None:
        nonlocal wall
        start = time.perf_counter()
        for _ in range(steps):
            bg.next()
        mx.synchronize()
        wall = time.perf_counter() - start

    totals = profile_kernels(run)
    bg.close()
    if totals is None:
        print("    no CUDA profiler here (torch with CUDA): nothing to report")
        return
    busy = sum(t.micros for t in totals.values())
    launches = sum(t.calls for t in totals.values())
    print(
        f"    wall {wall / steps * 1e3:.2f} ms a step, kernels {busy / steps / 1e3:.2f} ms a step"
        f" ({launches / steps:.0f} launches)"
    )
    for name, total in sorted(totals.items(), key=lambda kv: -kv[1].micros)[:top]:
        print(
            f"      {total.micros / steps:8.1f} us a step, {total.calls / steps:5.1f} calls,"
            f" {total.micros / max(total.calls, 1):7.2f} us a call: {name[:110]}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b-shape")
    parser.add_argument("--streams", default="1")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kernel", action="store_true", help="--deterministic-matmul kernel")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(model_spec(args.model, Path(tmp)), Path(tmp))
    print(f"{args.model} on {mx.default_device()}, MLX {mx.__version__}")
    rng = random.Random(1)
    sides = {
        "default": CompiledDecode(loaded.model, COMPILED_MAX_BATCH),
        "deterministic": engine_side(loaded.model, 0, args.kernel),
    }
    for n in [int(s) for s in args.streams.split(",")]:
        prompts = [[rng.randrange(3, loaded.vocab_size) for _ in range(128)] for _ in range(n)]
        for name, model in sides.items():
            print(f"  {n} streams, {name}:")
            profile_side(model, prompts, args.steps, args.top)


if __name__ == "__main__":
    main()
