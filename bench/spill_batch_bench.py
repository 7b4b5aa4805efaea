"""What batched checkpoint Puts buy: decode cost of checkpointing every 16 tokens with the spill
queue sending one Put a record (--spill-batch-records 1) beside PutMany batches (32), two
engines on one store, off/on pairs alternating between them (ABAB), medians of the rounds.

    python bench/spill_batch_bench.py [--model tandem-tiny|qwen3-0.6b-shape|PATH] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

from bench.checkpoint_bench import _decode  # noqa: E402
from bench.checkpoint_restore import random_prompt  # noqa: E402
from bench.engine_bench import model_spec  # noqa: E402
from tests.servers import start_engine, start_store  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tandem-tiny")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=256)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="spill-batch-"))
    spec = model_spec(a.model, root)
    store = start_store(root / "store", "--sync-mode", "none", "--capacity-bytes", str(64 << 30))
    engines = {
        batch: start_engine(
            root / f"engine-{batch}",
            "--model",
            spec,
            "--store",
            store.address,
            "--spill-batch-records",
            str(batch),
            "--spill-queue-bytes",
            str(16 << 30),
            log_dir=root / f"logs-{batch}",
        )  # fmt: skip
        for batch in (1, 32)
    }
    try:
        for engine in engines.values():  # warm: kernels compile on first use (MLX-CUDA)
            for streams in (1, 8):
                warm = [random_prompt(64, 2000, seed=1000 + i) for i in range(streams)]
                asyncio.run(_decode(engine.address, warm, 32, 16))
        for streams in (1, 8):
            prompts = [random_prompt(64, 2000, seed=1000 + i) for i in range(streams)]
            cost: dict[int, list[float]] = {1: [], 32: []}
            for r in range(a.rounds):
                for batch in (1, 32) if r % 2 == 0 else (32, 1):
                    address = engines[batch].address
                    off = asyncio.run(_decode(address, prompts, a.tokens, 0))
                    on = asyncio.run(_decode(address, prompts, a.tokens, 16))
                    cost[batch].append(1 - on / off)
            print(
                f"{streams} stream(s), checkpoint every 16 tokens: cost with one Put a record "
                f"{100 * statistics.median(cost[1]):.1f}% (rounds "
                f"{' '.join(f'{100 * c:.0f}' for c in cost[1])}), with PutMany "
                f"{100 * statistics.median(cost[32]):.1f}% (rounds "
                f"{' '.join(f'{100 * c:.0f}' for c in cost[32])})",
                flush=True,
            )
    finally:
        for engine in engines.values():
            engine.stop()
        store.stop()


if __name__ == "__main__":
    main()
