"""Where a speculative batch round's time goes (a diagnostic for the device): the plain
BatchGenerator step beside our round's phases (draft, verify + picks, rollbacks), with and
without wide reads, and attention at a new key length each call against a repeated one.

    python bench/speculative_phases.py [--target qwen3-0.6b-shape] [--streams 8] [--k 4]
"""

from __future__ import annotations

import argparse
import json
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
# isort: on

from bench.shapes import model_spec  # noqa: E402
from bench.speculative_bench import batch_plain  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402
from engine_service.protocol.sampling_options import SamplingOptions  # noqa: E402
from engine_service.speculative.batch import SpecRow, SpeculativeBatch, prefilled  # noqa: E402


def attention_times(heads: int, kv_heads: int, dim: int, rows: int, q: int) -> dict[str, float]:
    """ms a call: a fresh key length every call, then one length repeated."""
    out = {}
    for name, lengths in (("fresh", range(300, 340)), ("same", [300] * 40)):
        times = []
        for n in lengths:
            qs = mx.random.normal((rows, heads, q, dim)).astype(mx.bfloat16)
            ks = mx.random.normal((rows, kv_heads, n, dim)).astype(mx.bfloat16)
            mask = mx.ones((rows, 1, q, n), dtype=mx.bool_)
            mx.eval(qs, ks, mask)
            start = time.perf_counter()
            mx.eval(mx.fast.scaled_dot_product_attention(qs, ks, ks, scale=0.1, mask=mask))
            times.append(1000 * (time.perf_counter() - start))
        out[name] = statistics.median(times[5:])
    return out


def round_phases(batch: SpeculativeBatch, rounds: int) -> dict[str, float]:
    """Median ms of whole rounds, and of the draft alone (same rows, evaluated)."""
    unlimited = [1 << 30] * len(batch.rows)
    whole, made = [], 0
    for _ in range(rounds):
        start = time.perf_counter()
        made += sum(len(r.tokens) for r in batch.round(unlimited))
        whole.append(1000 * (time.perf_counter() - start))
    draft = []
    k = max(r.num_draft for r in batch.rows)
    for _ in range(5):
        start = time.perf_counter()
        drafts = batch._draft(k)  # noqa: SLF001  (a diagnostic)
        mx.eval(drafts)
        draft.append(1000 * (time.perf_counter() - start))
        fed = k + 1 if k else 2
        for cache in batch.draft_cache:  # back to where the draft was
            cache.rollback([fed] * len(batch.rows))
    return {
        "round_ms": statistics.median(whole[3:]),
        "tokens_per_round": made / rounds,
        "draft_ms": statistics.median(draft),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="qwen3-0.6b-shape")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--json")
    a = p.parse_args()
    out: dict[str, Any] = {"target": a.target, "device": str(mx.default_device())}
    with tempfile.TemporaryDirectory() as tmp:
        target = load_model(model_spec(a.target, Path(tmp) / "t"), Path(tmp))
        rng = random.Random(0)
        prompts = [
            [rng.randrange(3, target.vocab_size) for _ in range(256)] for _ in range(a.streams)
        ]
        batch_plain(target.model, prompts, 8)
        plain = batch_plain(target.model, prompts, 64)
        out["plain_step_ms"] = 1000 * a.streams / plain.tokens_per_s
        print(f"BatchGenerator step: {out['plain_step_ms']:.1f} ms")
        for wide in (False, True):
            batch = SpeculativeBatch(target.model, target.model, wide_reads=wide)
            for j, prompt in enumerate(prompts):
                row = SpecRow(str(j), list(prompt), 0, a.k, SamplingOptions())
                batch.add(
                    row, prefilled(target.model, prompt[:-1]), prefilled(target.model, prompt[:-2])
                )
            phases = round_phases(batch, a.rounds)
            out[f"wide_{wide}"] = phases
            print(f"wide reads {wide}: {phases}")
        args = target.model.args
        heads, kv = args.num_attention_heads, args.num_key_value_heads
        dim = getattr(args, "head_dim", None) or args.hidden_size // heads
        for q in (1, 2, a.k + 1):
            times = attention_times(heads, kv, dim, a.streams, q)
            out[f"sdpa_q{q}"] = times
            print(f"SDPA q={q}: {times}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
