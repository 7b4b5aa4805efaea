"""The model zoo served: the engine's core beside raw mlx-lm on each architecture.

    .venv/bin/python bench/zoo_bench.py [--archs qwen3,lfm2,...] [--streams 8] [--pairs 3]

For each zoo architecture (tests/model_zoo.py, tiny random-weight models), or a published
model's shape (bench/shapes.py, random weights: `--archs llama3.1-8b-shape`):
- decode: N greedy streams through mlx-lm's `BatchGenerator` directly (the baseline) and
  through the engine's core (`Scheduler`: our batch caches, samplers, stop handling, events),
  interleaved ABAB after a warm round of each; the median of the paired ratios (ours /
  mlx-lm) with their spread;
- the start-up probe's seconds (core/capability_probe.py);
- for architectures whose caches cannot be trimmed (recurrent, sliding windows): the time to
  the first token of a long prompt sent the first time (a prefix snapshot is taken during
  its prefill) and sent again (restored from it), beside mlx-lm prefilling it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402

import engine_service  # noqa: E402, F401
from bench.shapes import SHAPES, model_spec  # noqa: E402
from engine_service.checkpoints.manager import CheckpointManager, CheckpointSettings  # noqa: E402
from engine_service.core.capability_probe import probe  # noqa: E402
from engine_service.core.planner import Planner  # noqa: E402
from engine_service.loop.limits import Limits  # noqa: E402
from engine_service.loop.scheduler import Scheduler  # noqa: E402
from engine_service.model.loaded import LoadedModel  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402
from engine_service.protocol.events import Event, Finished, Started, Token  # noqa: E402
from engine_service.protocol.requests import DraftSupport  # noqa: E402
from tests.model_zoo import ZOO, build_zoo_model  # noqa: E402
from tests.zoo_checks import prompt_of, request  # noqa: E402


class Sink:
    def __init__(self) -> None:
        self.tokens = 0
        self.first = 0.0
        self.cached = 0
        self.submitted = 0.0
        self.done = threading.Event()

    def __call__(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, Token):
                if not self.tokens:
                    self.first = time.perf_counter()
                self.tokens += 1
            elif isinstance(e, Started):
                self.cached = e.cached_prompt_tokens
            elif isinstance(e, Finished):
                self.done.set()


def direct(loaded: LoadedModel, prompts: list[list[int]], n: int) -> float:
    bg = BatchGenerator(loaded.model, completion_batch_size=len(prompts), prefill_batch_size=8)
    uids = bg.insert(prompts, max_tokens=[n] * len(prompts))
    done, total = 0, 0
    start = time.perf_counter()
    while done < len(uids):
        _, responses = bg.next()
        total += len(responses)
        done += sum(r.finish_reason is not None for r in responses)
    wall = time.perf_counter() - start
    bg.close()
    return total / wall


def ours(scheduler: Scheduler, loaded: LoadedModel, prompts: list[list[int]], n: int) -> float:
    sinks = [Sink() for _ in prompts]
    start = time.perf_counter()
    for i, (p, sink) in enumerate(zip(prompts, sinks, strict=True)):
        scheduler.submit(request(loaded, f"bench-{time.monotonic_ns()}-{i}", p, max_tokens=n), sink)
    for sink in sinks:
        sink.done.wait(600)
    wall = time.perf_counter() - start
    return sum(s.tokens for s in sinks) / wall


def prefix_times(loaded: LoadedModel, length: int) -> dict[str, float]:
    """First token of a long prompt: mlx-lm alone, our first send (snapshot taken), again.
    Each path runs once on another prompt of the same length first (MLX-CUDA compiles a
    kernel per shape on first use), then on the measured prompt."""

    def mlx_lm(prompt: list[int]) -> float:
        start = time.perf_counter()
        next(generate_step(mx.array(prompt), loaded.model, max_tokens=1))
        return time.perf_counter() - start

    checkpoints = CheckpointManager(loaded, CheckpointSettings())  # the local tier only
    scheduler = Scheduler(loaded, Limits(max_running=8), checkpoints=checkpoints)
    scheduler.start()
    planner = Planner(checkpoints, DraftSupport())

    def ours(prompt: list[int], rid: str) -> Sink:
        r = request(loaded, rid, prompt, max_tokens=2)
        sink = Sink()
        sink.submitted = time.perf_counter()
        scheduler.submit(r, sink, planner.plan(r) if planner.needed(r) else None)
        sink.done.wait(600)
        return sink

    got: dict[str, float] = {}
    try:
        warm, measured = (prompt_of(length, seed, loaded.vocab_size) for seed in (41, 42))
        mlx_lm(warm)
        ours(warm, "warm-first"), ours(warm, "warm-again")
        got["mlx_lm_s"] = mlx_lm(measured)
        for label in ("first", "again"):
            sink = ours(measured, f"prefix-{label}")
            got[f"{label}_s"] = sink.first - sink.submitted
            got[f"{label}_cached"] = sink.cached
    finally:
        scheduler.shutdown()
        checkpoints.close()
    return got


def bench(
    arch: str, root: Path, streams: int, prompt_len: int, n: int, pairs: int, prefix_len: int
) -> dict[str, Any]:
    # A zoo architecture (tiny), or a published model's shape (bench/shapes.py, random weights).
    path = model_spec(arch, root / "shapes") if arch in SHAPES else build_zoo_model(arch, root)
    loaded = load_model(str(path), root / "data")
    start = time.perf_counter()
    probe(loaded, lambda: BatchGenerator(loaded.model, completion_batch_size=8))
    probe_s = time.perf_counter() - start
    scheduler = Scheduler(loaded, Limits(max_running=max(8, streams)))
    scheduler.start()
    prompts = [prompt_of(prompt_len, i, loaded.vocab_size) for i in range(streams)]
    try:
        direct(loaded, prompts, 8)  # warm both
        ours(scheduler, loaded, prompts, 8)
        ratios, bases, ourss = [], [], []
        for _ in range(pairs):
            base = direct(loaded, prompts, n)
            mine = ours(scheduler, loaded, prompts, n)
            bases.append(base)
            ourss.append(mine)
            ratios.append(mine / base)
    finally:
        scheduler.shutdown()
    result: dict[str, Any] = {
        "arch": arch,
        "layout": sorted(set(loaded.layout)),
        "mlx_lm_tok_s": statistics.median(bases),
        "ours_tok_s": statistics.median(ourss),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "probe_s": probe_s,
    }
    untrimmable = any(not c.startswith("kv:plain") for c in loaded.layout)
    if untrimmable:
        result["prefix"] = prefix_times(loaded, prefix_len)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--archs", default=",".join(sorted(ZOO)))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--json")
    a = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="zoo-bench-"))
    print(
        f"device {mx.default_device()}, {a.streams} streams, {a.max_tokens} tokens, ABAB x{a.pairs}"
    )
    print(
        f"{'arch':18s} {'mlx-lm tok/s':>12s} {'ours tok/s':>10s} {'ratio':>6s} {'spread':>12s} "
        f"{'probe s':>7s}  prefix {a.prefix_tokens} (mlx-lm / first / again)"
    )
    results = []
    for arch in a.archs.split(","):
        r = bench(arch, root, a.streams, a.prompt_tokens, a.max_tokens, a.pairs, a.prefix_tokens)
        results.append(r)
        p = r.get("prefix")
        prefix = (
            f"{p['mlx_lm_s']:.3f} / {p['first_s']:.3f} / {p['again_s']:.3f} s "
            f"(cached {p['again_cached']:.0f})"
            if p
            else "-"
        )
        print(
            f"{arch:18s} {r['mlx_lm_tok_s']:12.0f} {r['ours_tok_s']:10.0f} {r['ratio']:6.2f} "
            f"{r['ratio_min']:5.2f}-{r['ratio_max']:<5.2f} {r['probe_s']:7.2f}  {prefix}",
            flush=True,
        )
    ratios = [r["ratio"] for r in results]
    print(f"median ratio over {len(ratios)} architectures: {statistics.median(ratios):.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # past MLX's native threads' teardown (it aborted now and then at exit)
