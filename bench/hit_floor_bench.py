"""A store hit against the floor under any store hit, interleaved (ABAB).

A: the engine (no local tier, so the hit is the store's) answers a follow-up turn of 16 new
   tokens after a prefix of --tokens tokens it saved to the store: time to its first token
   over gRPC.
B: raw mlx-lm's `BatchGenerator`, in this process, given that prefix's cache already in
   memory (a deep copy) and the same 16 tokens: time to its first token.

Each pair is a new prompt; the first pair warms both up and is dropped. Prints the median of
the paired ratios A / B and their spread (issue 37's CPU aim: within 1.3x).

    python bench/hit_floor_bench.py [--model tandem-tiny] [--tokens 4096] [--pairs 7]
"""

from __future__ import annotations

import argparse
import copy
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
# isort: on

from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from bench.checkpoint_restore import random_prompt  # noqa: E402
from bench.engine_bench import model_spec  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402
from tandem_client import EngineClient  # noqa: E402
from tests.servers import free_port, start_engine, start_store_on  # noqa: E402


def engine_hit(client: EngineClient, base: list[int], turn: list[int], namespace: str) -> float:
    """The follow-up's time to first token, its prefix saved to the store first."""
    client.generate(base, max_tokens=1, ignore_eos=True, namespace=namespace)
    client.flush()  # the prefix is in the store
    start = time.perf_counter()
    for chunk in client.stream(base + turn, max_tokens=1, ignore_eos=True, namespace=namespace):
        if chunk.usage is not None:
            elapsed = time.perf_counter() - start
            if chunk.usage.cached_prompt_tokens < len(base) - 64:
                raise RuntimeError(f"not a store hit: {chunk.usage}")
            client.flush()  # its own prefix's save ends before the next measurement
            return elapsed
    raise RuntimeError("no usage")


def raw_from_memory(loaded, base: list[int], turn: list[int]) -> float:  # noqa: ANN001
    """mlx-lm's BatchGenerator from the prefix's cache in memory, to its first token."""
    cache = make_prompt_cache(loaded.model)
    for at in range(0, len(base), 2048):
        loaded.model(mx.array([base[at : at + 2048]]), cache=cache)
        mx.eval([c.state for c in cache])
    copied = [copy.deepcopy(c) for c in cache]
    mx.eval([c.state for c in copied])
    generator = BatchGenerator(loaded.model, stop_tokens=set())
    start = time.perf_counter()
    generator.insert([turn], max_tokens=[1], caches=[copied])
    while not generator.next()[1]:
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--pairs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-hit-floor-") as tmp:
        root = Path(tmp)
        spec = model_spec(args.model, root)
        port = free_port()
        store = start_store_on(root / "store", port, "--sync-mode", "none")
        engine = start_engine(
            root,
            "--model",
            spec,
            "--store",
            f"127.0.0.1:{port}",
            "--prefix-cache-bytes",
            "0",
            log_dir=root,
        )
        loaded = load_model(spec, root)
        hits, raws, ratios = [], [], []
        try:
            with EngineClient(engine.address, timeout=1800) as client:
                vocab = client.model_info().vocab_size
                for r in range(args.pairs + 1):
                    base = random_prompt(args.tokens, vocab, seed=7_000 + r)
                    turn = random_prompt(16, vocab, seed=r)
                    hit = engine_hit(client, base, turn, f"pair-{r}")
                    raw = raw_from_memory(loaded, base, turn)
                    if r:  # the first pair warms both up
                        hits.append(hit)
                        raws.append(raw)
                        ratios.append(hit / raw)
                        print(f"  pair {r}: store hit {hit * 1e3:7.1f} ms, raw {raw * 1e3:7.1f} ms")
                routes = dict(client.stats().checkpoints.store_reads_by_route)
        finally:
            engine.stop()
            store.stop()
    print(
        f"{args.model} on {mx.default_device()}, {args.tokens} + 16 tokens, {args.pairs} pairs:"
        f" store hit {statistics.median(hits) * 1e3:.1f} ms, raw mlx-lm from memory"
        f" {statistics.median(raws) * 1e3:.1f} ms; hit / raw median {statistics.median(ratios):.2f}"
        f" ({min(ratios):.2f}-{max(ratios):.2f}); store reads by route {routes}"
    )


if __name__ == "__main__":
    main()
