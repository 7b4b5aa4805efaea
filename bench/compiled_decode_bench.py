"""The compiled decode step against the eager one, on the engine's own batch rows, beside
mlx-lm's own batch cache.

The same prompts go through mlx-lm's BatchGenerator three ways: with its own caches
(BatchKVCache: the baseline), with the engine's cache rows (NewRows: BatchQuantizedKVCache,
plain) and the model as loaded, and with those rows and the model wrapped in CompiledDecode,
rotating the order over --pairs rounds; medians of the paired ratios, min-max.

    python bench/compiled_decode_bench.py [--model tandem-tiny|qwen3-0.6b-shape|PATH]
        [--streams 1,8,32] [--tokens 256] [--pairs 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
# isort: on

from bench.engine_bench import model_spec, prompts  # noqa: E402
from engine_service.loop.compiled_decode import CompiledDecode  # noqa: E402
from engine_service.loop.jobs import Job, StartingPoint  # noqa: E402
from engine_service.loop.new_rows import NewRows  # noqa: E402
from engine_service.model.loaded import LoadedModel  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402
from engine_service.protocol.requests import GenerationRequest  # noqa: E402
from engine_service.protocol.sampling_options import SamplingOptions  # noqa: E402


def decode(
    model: object, loaded: LoadedModel, batch: list[list[int]], tokens: int, engine_rows: bool
) -> float:
    """Decode tokens/s over the batch (prefill excluded: the clock starts at the first token)."""
    bg = BatchGenerator(model, completion_batch_size=max(32, len(batch)), prefill_batch_size=8)
    if engine_rows:
        rows = NewRows(loaded.model)
        for i, prompt in enumerate(batch):
            request = GenerationRequest(f"b{i}", prompt, tokens, SamplingOptions(), "")
            rows.add(Job(request, lambda events: None), StartingPoint(prompt, [], None, 0))
        rows.insert(bg)
        uids = [job.uid for job in rows.jobs]
    else:
        uids = bg.insert(batch, max_tokens=[tokens] * len(batch))
    left, produced, start = set(uids), 0, 0.0
    while left:
        _, responses = bg.next()
        if responses and not start and len(responses) == len(batch):
            start = time.perf_counter()
            continue
        produced += len(responses) if start else 0
        left -= {r.uid for r in responses if r.finish_reason is not None}
    elapsed = time.perf_counter() - start
    bg.close()
    mx.clear_cache()
    return produced / elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tandem-tiny")
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--pairs", type=int, default=5)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-compiled-bench-") as tmp:
        loaded = load_model(model_spec(a.model, Path(tmp)), Path(tmp))
        compiled = CompiledDecode(loaded.model)
        sides = {
            "mlx-lm": (loaded.model, False),
            "eager": (loaded.model, True),
            "compiled": (compiled, True),
        }
        print(f"{a.model} on {mx.default_device()}, {a.tokens} tokens a stream, {a.pairs} pairs")
        print(
            f"{'streams':>7} {'mlx-lm':>8} {'eager':>8} {'compiled':>9} "
            f"{'compiled/eager':>18} {'compiled/mlx-lm':>18} {'eager/mlx-lm':>18}   (tok/s)"
        )
        for n in (int(s) for s in a.streams.split(",")):
            for model, engine_rows in sides.values():  # warm: traces and kernels of this shape
                decode(model, loaded, prompts(n, 64, loaded.vocab_size, 7), 32, engine_rows)
            rates: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(a.pairs):
                batch = prompts(n, 64, loaded.vocab_size, 100 + r)
                order = list(sides.items())
                order = order[r % 3 :] + order[: r % 3]  # each side first in turn
                for name, (model, engine_rows) in order:
                    rates[name].append(decode(model, loaded, batch, a.tokens, engine_rows))
            print(
                f"{n:>7} {statistics.median(rates['mlx-lm']):>8.0f} "
                f"{statistics.median(rates['eager']):>8.0f} "
                f"{statistics.median(rates['compiled']):>9.0f} "
                f"{_ratio(rates['compiled'], rates['eager']):>18} "
                f"{_ratio(rates['compiled'], rates['mlx-lm']):>18} "
                f"{_ratio(rates['eager'], rates['mlx-lm']):>18}"
            )
        print(f"compiled steps: {compiled.compiled_steps}")


def _ratio(ours: list[float], base: list[float]) -> str:
    ratios = [o / b for o, b in zip(ours, base, strict=True)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


if __name__ == "__main__":
    main()
