"""Batched quantized KV caches: bytes per token, decode rate, and streams per memory budget.

For each KV codec (plain = the model's dtype, affine 8-bit and 4-bit, TurboQuant 4/4 and 3/3
bits) and each batch size (default 8 and 32), in one run: mlx-lm's BatchGenerator decodes
`--steps` tokens per stream after prompts of `--prompt` tokens, with the baseline's caches
(mlx-lm's own BatchKVCache, plain only: it cannot batch QuantizedKVCache) and with ours
(BatchQuantizedKVCache rows, which is what the engine runs). Decode time is measured from the
step at which every row is generating. Each round runs the baseline and every codec once, in
an order that rotates round by round; a codec's ratio is the median of its per-round ratios
to that round's baseline, with their min-max. Prints decode tokens/s and the ratio to the
baseline, KV bytes per token of one row (its extracted caches over the tokens they hold), and
how many `--stream-tokens`-token streams fit `--budget-gib`.

    python bench/kv_quant_bench.py [--model tandem-tiny|qwen3-0.6b-shape|PATH]
        [--streams 8,32] [--prompt 1024] [--steps 64] [--repeat 3] [--budget-gib 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
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
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
# isort: on

from bench.shapes import model_spec  # noqa: E402
from engine_service import blas  # noqa: E402
from engine_service.kv.batch_cache import adopt_row  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402
from engine_service.protocol.kv_codec import KVCodec  # noqa: E402

CODECS = {
    "plain": KVCodec(),
    "8-bit": KVCodec(8, 64, 0),
    "4-bit": KVCodec(4, 64, 0),
    "tq-4/4": KVCodec.turboquant(4, 4),
    "tq-3/3": KVCodec.turboquant(3, 3),
}


def decode_run(
    model: Any, prompts: list[list[int]], steps: int, codec: KVCodec | None
) -> tuple[float, float]:
    """(decode tokens/s over `steps` steps with every row generating, KV bytes per token of
    one row's caches). codec None: mlx-lm's default caches (the baseline)."""
    bg = BatchGenerator(
        model, completion_batch_size=len(prompts), prefill_batch_size=min(8, len(prompts))
    )
    caches = None
    if codec is not None:
        caches = [[adopt_row(c, codec) for c in make_prompt_cache(model)] for _ in prompts]
    # Rows never finish inside the timed window: prefill is staggered over batches of 8.
    limit = steps + 2 * len(prompts) + 8
    uids = bg.insert(prompts, max_tokens=[limit] * len(prompts), caches=caches)
    started: set[int] = set()
    while len(started) < len(uids):  # prefill, until every row has its first token
        started.update(r.uid for r in bg.next()[1])
    tokens = 0
    start = time.perf_counter()
    for _ in range(steps):
        tokens += len(bg.next()[1])
    wall = time.perf_counter() - start
    (row, held) = bg.extract_cache([uids[0]])[uids[0]]
    per_token = sum(c.nbytes for c in row) / len(held)
    bg.close()
    return tokens / wall, per_token


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--streams", default="8,32")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--stream-tokens", type=int, default=2048)
    parser.add_argument("--codecs", default=",".join(CODECS), help="which of " + ",".join(CODECS))
    parser.add_argument("--json")
    args = parser.parse_args()
    out: dict[str, Any] = {
        "model": args.model,
        "device": str(mx.default_device()),
        "blas": blas.in_use(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {os.cpu_count()} cores",
        "prompt": args.prompt,
        "steps": args.steps,
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="tandem-kvq-bench-") as tmp:
        spec = model_spec(args.model, Path(tmp))
        loaded = load_model(spec, Path(tmp))
        model = loaded.model
        vocab = loaded.vocab_size
        print(
            f"model {args.model} ({loaded.dtype}) on {out['device']}, prompt {args.prompt} + "
            f"{args.steps} decode steps, medians of {args.repeat}"
        )
        rng = random.Random(0)
        budget = args.budget_gib * (1 << 30)
        for streams in [int(s) for s in args.streams.split(",")]:
            prompts = [
                [rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(streams)
            ]
            chosen = {name: CODECS[name] for name in args.codecs.split(",")}
            decode_run(model, prompts[:2], 4, None)  # warm-up: kernels compile once
            for codec in chosen.values():
                decode_run(model, prompts[:2], 4, codec)
            sides: dict[str, KVCodec | None] = {"baseline": None, **chosen}
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
            names = list(sides)
            for r in range(args.repeat):  # interleaved, the order rotating each round
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    runs[name].append(decode_run(model, prompts, args.steps, sides[name]))
            base = [t for t, _ in runs["baseline"]]
            plain_bpt = None
            for name in names:
                tps = statistics.median(t for t, _ in runs[name])
                ratios = [t / b for (t, _), b in zip(runs[name], base, strict=True)]
                ratio = statistics.median(ratios)
                per_token = runs[name][-1][1]
                fit = int(budget // (per_token * args.stream_tokens))
                if name == "plain":
                    plain_bpt = per_token
                row = {
                    "streams": streams,
                    "kv": name,
                    "decode_tokens_per_s": round(tps, 1),
                    "ratio_to_baseline": round(ratio, 3),
                    "ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
                    "kv_bytes_per_token": round(per_token),
                    "streams_in_budget": fit,
                    "capacity_vs_plain": round(plain_bpt / per_token, 2) if plain_bpt else None,
                }
                out["rows"].append(row)
                print(
                    f"  {streams:>3} streams {name:>8}: {tps:8.1f} tok/s "
                    f"(x{ratio:.3f} [{min(ratios):.2f}-{max(ratios):.2f}] of mlx-lm "
                    "BatchKVCache), "
                    f"{per_token / 1024:7.1f} KiB/token, {fit} x {args.stream_tokens}-token "
                    f"streams in {args.budget_gib:g} GiB"
                    + (f" ({plain_bpt / per_token:.2f}x plain)" if plain_bpt else "")
                )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
