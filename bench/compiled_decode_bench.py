"""The compiled decode step against the eager one, on the engine's own batch rows.

The same prompts go through mlx-lm's BatchGenerator with the engine's cache rows (NewRows:
BatchQuantizedKVCache, plain), once with the model as loaded and once wrapped in
CompiledDecode, alternating over --pairs rounds; medians of the paired ratios, min-max.

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
from engine_service.compiled_decode import CompiledDecode  # noqa: E402
from engine_service.jobs import Job, StartingPoint  # noqa: E402
from engine_service.model import LoadedModel, load_model  # noqa: E402
from engine_service.new_rows import NewRows  # noqa: E402
from engine_service.requests import GenerationRequest  # noqa: E402
from engine_service.sampling import SamplingOptions  # noqa: E402


def decode(model: object, loaded: LoadedModel, batch: list[list[int]], tokens: int) -> float:
    """Decode tokens/s over the batch (prefill excluded: the clock starts at the first token)."""
    bg = BatchGenerator(model, completion_batch_size=max(32, len(batch)), prefill_batch_size=8)
    rows = NewRows(loaded.model)
    for i, prompt in enumerate(batch):
        request = GenerationRequest(f"b{i}", prompt, tokens, SamplingOptions(), "")
        rows.add(Job(request, lambda events: None), StartingPoint(prompt, [], None, 0))
    rows.insert(bg)
    left, produced, start = {job.uid for job in rows.jobs}, 0, 0.0
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
        sides = {"eager": loaded.model, "compiled": compiled}
        print(f"{a.model} on {mx.default_device()}, {a.tokens} tokens a stream, {a.pairs} pairs")
        print(f"{'streams':>7} {'eager':>8} {'compiled':>9} {'compiled/eager':>18}   (tok/s)")
        for n in (int(s) for s in a.streams.split(",")):
            for model in sides.values():  # warm: traces and kernels of this shape
                decode(model, loaded, prompts(n, 64, loaded.vocab_size, 7), 32)
            rates: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(a.pairs):
                batch = prompts(n, 64, loaded.vocab_size, 100 + r)
                order = list(sides.items())
                for name, model in order if r % 2 == 0 else order[::-1]:
                    rates[name].append(decode(model, loaded, batch, a.tokens))
            ratios = [c / e for c, e in zip(rates["compiled"], rates["eager"], strict=True)]
            print(
                f"{n:>7} {statistics.median(rates['eager']):>8.0f} "
                f"{statistics.median(rates['compiled']):>9.0f} "
                f"{statistics.median(ratios):>8.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            )
        print(f"compiled steps: {compiled.compiled_steps}")


if __name__ == "__main__":
    main()
