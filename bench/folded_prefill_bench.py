"""Time to the first token: mlx-lm's BatchGenerator against the engine's folding one (ABAB).

A: mlx-lm's `BatchGenerator`: it prefills a prompt but its last token, then runs that token as
   a decode step of its own whose logits give the first token.
B: `FoldingBatchGenerator` (engine_service/model/folded_prefill.py): a short last chunk carries
   the last token and gives the first token itself, one forward pass fewer.

Each round: --rows rows of --turn new tokens, each after a --prefix-token cache already in
memory (a store hit's shape; --prefix 0: a short cold prompt), deep-copied for each side, to
the first token of every row. The first round warms both and is dropped. Prints each side's
median and the median of the paired ratios B / A with their spread. --turn takes a list: the
fold runs the model's last layer over every position of the chunk, so past some length it
costs more than the step it saves; each line says whether the engine folds a chunk that long
(`fold_limit`).

    python bench/folded_prefill_bench.py [--model tandem-tiny] [--prefix 4096] [--turn 16[,256]]
        [--rows 1] [--pairs 9]
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
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
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from bench.shapes import load_shape  # noqa: E402
from engine_service.model.folded_prefill import FoldingBatchGenerator, fold_limit  # noqa: E402
from engine_service.model.last_positions import LastPositions  # noqa: E402


def first_tokens(generator: BatchGenerator, turns: list[list[int]], caches: list[Any]) -> float:
    """Seconds from insert to every row's first token."""
    start = time.perf_counter()
    generator.insert(turns, max_tokens=[2] * len(turns), caches=caches)
    left = len(turns)
    while left:
        left -= sum(1 for r in generator.next()[1] if r.finish_reason is None)
    elapsed = time.perf_counter() - start
    generator.close()
    return elapsed


def prefilled(model: Any, vocab: int, length: int, rng: random.Random) -> list[Any]:
    """A cache of `length` random tokens, prefilled in 2,048-token chunks."""
    cache = make_prompt_cache(model)
    tokens = [rng.randrange(3, vocab - 1) for _ in range(length)]
    for at in range(0, length, 2048):
        model(mx.array([tokens[at : at + 2048]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tandem-tiny")
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--turn", default="16", help="new tokens a row; a list: one line each")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=9)
    args = ap.parse_args()
    loaded = load_shape(args.model)
    model, vocab = loaded.model, loaded.vocab_size
    rng = random.Random(0)
    prefixes = [prefilled(model, vocab, args.prefix, rng) for _ in range(args.rows)]

    def copies() -> list[Any]:
        out = [[copy.deepcopy(c) for c in cache] for cache in prefixes]
        mx.eval([c.state for cache in out for c in cache])
        return out

    positions = LastPositions.probe(model)
    assert positions is not None, "this model's first tokens cannot come from its chunks"
    limit = fold_limit(model)
    for turn in [int(t) for t in args.turn.split(",")]:
        upstream: list[float] = []
        folded: list[float] = []
        for r in range(args.pairs + 1):
            turns = [[rng.randrange(3, vocab - 1) for _ in range(turn)] for _ in prefixes]
            a = first_tokens(BatchGenerator(model), turns, copies() if args.prefix else [])
            folding = FoldingBatchGenerator(model, positions)  # always folds: the fold measured
            b = first_tokens(folding, turns, copies() if args.prefix else [])
            assert folding.folded_rows == args.rows, "the last chunk did not fold"
            print(f"  round {r}: mlx-lm {a * 1e3:8.1f} ms, folded {b * 1e3:8.1f} ms")
            if r:  # the first round warms both up
                upstream.append(a)
                folded.append(b)
        ratios = sorted(b / a for a, b in zip(upstream, folded, strict=True))
        engine = "folds" if limit is None or turn <= limit else f"does not fold (limit {limit})"
        print(
            f"{args.model} on {mx.default_device()}, {args.rows} row(s) of {turn} tokens after"
            f" {args.prefix}, {args.pairs} pairs: mlx-lm {statistics.median(upstream) * 1e3:.1f}"
            f" ms, folded {statistics.median(folded) * 1e3:.1f} ms to the first token; folded /"
            f" mlx-lm median {statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f});"
            f" the engine {engine}"
        )


if __name__ == "__main__":
    main()
