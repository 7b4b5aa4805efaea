"""How often a request's tokens under continuous batching equal its solo run.

Runs N prompts of different lengths solo and then together through mlx-lm's BatchGenerator
(greedy), on the same model, and reports per stream whether the tokens match and where they
first differ. Batched matmuls may use other kernels / reduction orders than batch-1 ones, so
logits can differ in the last bits and flip a near-tie argmax; this measures how often.

    python bench/batch_parity.py [--model tandem-tiny|qwen3-0.6b-shape|PATH] [--streams 8]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
# isort: on

from bench.engine_bench import model_spec  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402


def run(model, prompts: list[list[int]], n: int) -> list[list[int]]:  # noqa: ANN001
    bg = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=8)
    uids = bg.insert(prompts, max_tokens=[n] * len(prompts))
    out: dict[int, list[int]] = {u: [] for u in uids}
    finished = 0
    while finished < len(uids):
        _, responses = bg.next()
        for r in responses:
            out[r.uid].append(r.token)
            finished += r.finish_reason is not None
    bg.close()
    return [out[u] for u in uids]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = model_spec(args.model, Path(tmp))
        loaded = load_model(spec, Path(tmp))
        rng = random.Random(0)
        prompts = [
            [rng.randrange(3, loaded.vocab_size) for _ in range(16 + 9 * i)]
            for i in range(args.streams)
        ]
        solo = [run(loaded.model, [p], args.max_tokens)[0] for p in prompts]
        together = run(loaded.model, prompts, args.max_tokens)
    rows = []
    for i, (a, b) in enumerate(zip(solo, together, strict=True)):
        first = next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        rows.append(
            {
                "stream": i,
                "prompt_tokens": len(prompts[i]),
                "equal": a == b,
                "first_difference": first,
            }
        )
    equal = sum(r["equal"] for r in rows)
    print(
        f"{args.model} on {mx.default_device()} ({loaded.dtype}): {equal}/{len(rows)} streams "
        f"equal their solo run over {args.max_tokens} greedy tokens"
    )
    for r in rows:
        if not r["equal"]:
            print(
                f"  stream {r['stream']} ({r['prompt_tokens']} prompt tokens) first differs "
                f"at token {r['first_difference']}"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"model": args.model, "device": str(mx.default_device()), "rows": rows}, indent=2
            )
        )


if __name__ == "__main__":
    main()
