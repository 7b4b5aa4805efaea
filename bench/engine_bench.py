"""Engine throughput: gRPC streams through `tandem-engine` beside mlx-lm's BatchGenerator.

On the same model in one run, for each concurrency (default 1, 8, 32): the baseline calls
BatchGenerator directly in this process (greedy, every request inserted at once); ours
starts an engine process and opens that many concurrent Generate streams (greedy). Both
generate the same number of tokens per request from prompts of the same length. Prints
aggregate generated tokens/s, the ratio, and median time to first token.

    python bench/engine_bench.py [--model tandem-tiny|PATH|qwen3-0.6b-shape] [--streams 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
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
from mlx_lm.sample_utils import make_sampler  # noqa: E402
# isort: on

import grpc  # noqa: E402

from engine_service import blas  # noqa: E402
from engine_service.default_model import build_model_dir  # noqa: E402
from engine_service.model import load_model  # noqa: E402
from tandem_wire.pb import engine_pb2, engine_pb2_grpc  # noqa: E402
from tests.servers import start_engine  # noqa: E402

SHAPES = {
    # Random-weight stand-ins for real checkpoints (no downloads here).
    "qwen3-0.6b-shape": {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
    },
    "llama3-8b-shape": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    },
}


def model_spec(spec: str, root: Path, shapes: dict[str, dict] | None = None) -> str:
    """A model spec the engine can load: a shape name (SHAPES) becomes a random-weight
    directory under root (fp32 on the CPU, bf16 on a GPU); anything else is returned as is."""
    shapes = SHAPES if shapes is None else shapes
    if spec not in shapes:
        return spec
    dtype = "float32" if mx.default_device() == mx.cpu else "bfloat16"
    build_model_dir(shapes[spec], root / spec, dtype=dtype)
    return str(root / spec)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def direct(
    model,
    batch: list[list[int]],
    max_tokens: int,  # noqa: ANN001
    temperature: float = 0.0,
) -> dict[str, float]:
    # Sampled baseline: mlx-lm's own sampler, one shared object (one batched draw per step
    # from the global random state) - what BatchGenerator does without per-request seeds.
    sampler = make_sampler(temp=temperature) if temperature else None
    bg = BatchGenerator(
        model, sampler=sampler, completion_batch_size=max(32, len(batch)), prefill_batch_size=8
    )
    start = time.perf_counter()
    uids = bg.insert(batch, max_tokens=[max_tokens] * len(batch))
    first: dict[int, float] = {}
    done = 0
    total = 0
    while done < len(uids):
        _, responses = bg.next()
        now = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, now - start)
            total += 1
            if r.finish_reason is not None:
                done += 1
    wall = time.perf_counter() - start
    bg.close()
    return {
        "tokens_per_s": total / wall,
        "ttft_s": statistics.median(first.values()),
        "tokens": total,
    }


def through_engine(
    address: str, batch: list[list[int]], max_tokens: int, temperature: float = 0.0
) -> dict[str, float]:
    """All streams from one asyncio client (one thread), so the client's own CPU use stays
    small on a 2-core machine where it competes with the engine."""
    return asyncio.run(_through_engine(address, batch, max_tokens, temperature))


async def _through_engine(
    address: str, batch: list[list[int]], max_tokens: int, temperature: float
) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        start = time.perf_counter()

        async def one(i: int, prompt: list[int]) -> tuple[int, float]:
            sampling = engine_pb2.SamplingParams(ignore_eos=True, temperature=temperature, seed=i)
            request = engine_pb2.GenerateRequest(
                token_ids=prompt, max_tokens=max_tokens, sampling=sampling
            )
            count, first = 0, 0.0
            async for message in stub.Generate(request):
                if message.token_ids and not count:
                    first = time.perf_counter() - start
                count += len(message.token_ids)
            return count, first

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
        wall = time.perf_counter() - start
    total = sum(c for c, _ in results)
    return {
        "tokens_per_s": total / wall,
        "ttft_s": statistics.median(f for _, f in results),
        "tokens": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="> 0: seeded per-request sampling in the engine vs mlx-lm's "
        "shared sampler in the baseline",
    )
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tandem-engine-bench-") as tmp:
        data_dir = Path(tmp)
        spec = model_spec(args.model, data_dir)
        loaded = load_model(spec, data_dir)
        vocab = loaded.vocab_size
        streams = [int(s) for s in args.streams.split(",")]
        out: dict[str, object] = {
            "model": args.model,
            "model_id": loaded.model_id,
            "device": str(mx.default_device()),
            "blas": blas.in_use(),
            "machine": f"{platform.node()} {os.cpu_count()} cores",
            "date": time.strftime("%Y-%m-%d"),
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "rows": [],
        }
        # Warm up kernels (first use compiles on GPU).
        direct(loaded.model, prompts(2, args.prompt_tokens, vocab, 0), 8)
        baseline = {}
        for n in streams:
            runs = [
                direct(
                    loaded.model,
                    prompts(n, args.prompt_tokens, vocab, n),
                    args.max_tokens,
                    args.temperature,
                )
                for _ in range(args.repeat)
            ]
            baseline[n] = runs
        del loaded
        mx.clear_cache()

        proc = start_engine(
            data_dir, "--model", spec, "--max-running", str(max(streams)), log_dir=data_dir
        )
        try:
            through_engine(proc.address, prompts(2, args.prompt_tokens, vocab, 0), 8)
            mode = f"sampled T={args.temperature}" if args.temperature else "greedy"
            out["sampling"] = mode
            print(
                f"model {args.model} on {out['device']} (BLAS: {out['blas']}), {mode}, prompt "
                f"{args.prompt_tokens} tokens, {args.max_tokens} generated per stream, "
                f"medians of {args.repeat}"
            )
            print(
                f"{'streams':>8} {'direct tok/s':>13} {'engine tok/s':>13} {'ratio':>6} "
                f"{'direct ttft':>12} {'engine ttft':>12}"
            )
            for n in streams:
                ours = [
                    through_engine(
                        proc.address,
                        prompts(n, args.prompt_tokens, vocab, n),
                        args.max_tokens,
                        args.temperature,
                    )
                    for _ in range(args.repeat)
                ]
                d = statistics.median(r["tokens_per_s"] for r in baseline[n])
                e = statistics.median(r["tokens_per_s"] for r in ours)
                dt = statistics.median(r["ttft_s"] for r in baseline[n])
                et = statistics.median(r["ttft_s"] for r in ours)
                out["rows"].append(
                    {
                        "streams": n,
                        "direct_tps": d,
                        "engine_tps": e,
                        "ratio": e / d,
                        "direct_ttft_s": dt,
                        "engine_ttft_s": et,
                    }
                )
                print(
                    f"{n:>8} {d:>13.0f} {e:>13.0f} {e / d:>6.2f} {dt * 1e3:>10.0f}ms "
                    f"{et * 1e3:>10.0f}ms"
                )
        finally:
            proc.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
