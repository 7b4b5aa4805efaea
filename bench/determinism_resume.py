"""Deterministic mode through the engine: batched streams killed, resumed, against solo runs.

For each run: a store and a `--deterministic` engine on --model; --streams seeded streams of
different prompt lengths start together, each checkpointing every 16 tokens; once every
stream's checkpoint holds 32 generated tokens the engine is SIGKILLed; a fresh deterministic
engine resumes all of them together; then each request runs alone on it. A stream is exact
when what it received before the kill plus its resumed tokens equal its solo run, and so do
the log-probabilities, bit for bit. Prints exact streams per run (issue 39: 8/8 in repeated
runs).

    python bench/determinism_resume.py [--model qwen3-0.6b-shape] [--streams 8] [--runs 2]
        [--tokens 96]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from bench.engine_bench import model_spec  # noqa: E402
from tandem_client import EngineClient  # noqa: E402
from tandem_client.store_client import StoreClient  # noqa: E402
from tests.batched_resume import (  # noqa: E402
    all_checkpointed,
    logprobs_of,
    resume_together,
    run_alone,
    stream_together,
    tokens_of,
)
from tests.servers import free_port, start_engine, start_store_on, wait_until  # noqa: E402

CHECKPOINT_EVERY = 16


def run_once(
    spec: str, root: Path, streams: int, tokens: int, seed: int, matmul: str = "blocks"
) -> int:
    port = free_port()
    store_proc = start_store_on(root / "store", port)
    store = StoreClient(f"127.0.0.1:{port}")
    args = ["--model", spec, "--store", f"127.0.0.1:{port}", "--deterministic"]
    args += ["--deterministic-matmul", matmul]
    engine = start_engine(root / "data", *args, log_dir=root / "first", timeout=900)
    rng = random.Random(seed)
    vocab = EngineClient(engine.address).model_info().vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(20 + 61 * i)] for i in range(streams)]
    requests: list[dict[str, Any]] = [
        dict(
            max_tokens=tokens,
            ignore_eos=True,
            temperature=0.8,
            seed=seed * 100 + i,
            checkpoint_interval=CHECKPOINT_EVERY,
            logprobs=0,
            request_id=f"run{seed}-{i}",
        )
        for i in range(streams)
    ]
    exact = 0
    try:
        received, threads = stream_together(engine.address, prompts, requests)
        # Prompts 61 tokens apart, rows in step.
        wait_until(
            lambda: all_checkpointed(store, prompts, 2 * CHECKPOINT_EVERY),
            timeout=600,
            what="every stream's checkpoint",
        )
        engine.kill()
        for t in threads:
            t.join(60)
        held = [tokens_of(r) for r in received]
        fresh = start_engine(root / "data", *args, log_dir=root / "fresh", timeout=900)
        try:
            resumed = resume_together(fresh.address, prompts, requests, held)
            for i, alone in enumerate(run_alone(fresh.address, prompts, requests)):
                again = resumed[i]
                if again is None:
                    continue
                same_tokens = held[i] + again.token_ids == alone.token_ids
                same_bits = logprobs_of(received[i]) + logprobs_of(again.chunks) == logprobs_of(
                    alone.chunks
                )
                exact += same_tokens and same_bits
        finally:
            fresh.stop()
    finally:
        engine.stop()
        store.close()
        store_proc.stop()
    return exact


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument(
        "--matmul",
        choices=["auto", "blocks", "kernel"],
        default="auto",
        help="--deterministic-matmul",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-determinism-") as tmp:
        spec = model_spec(args.model, Path(tmp))
        for run in range(args.runs):
            root = Path(tmp) / f"run{run}"
            exact = run_once(spec, root, args.streams, args.tokens, run + 1, args.matmul)
            print(
                f"{args.model}, run {run + 1}: {exact}/{args.streams} streams killed in a batch"
                f" and resumed together equal their solo run (tokens and log-probabilities)",
                flush=True,
            )


if __name__ == "__main__":
    main()
