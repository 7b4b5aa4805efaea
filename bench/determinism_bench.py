"""Deterministic mode's agreement and cost (issue 39), through mlx-lm's BatchGenerator.

0. the start-up probe (model/determinism_probe.py) on this device: the model's rows alone and
   beside others, and the compiled decode step against the eager one; --probe-zoo runs it on
   zoo shapes too (a mixture-of-experts one, for instance).
1. kernel check (MLX-CUDA only): kv/row_attention_cuda.py against MLX's SDPA on rows of
   different lengths in one left-padded batch (max |difference|), each row alone against the
   same row in the batch, and the kernel inside mx.compile (array paddings, wider planes)
   against the eager call (bit-identical or not).
2. agreement: 8 target prompts run alone, then inside batches of --batches rows (the targets
   plus others of other lengths), greedy and seeded (our per-row SeededSampler), for --tokens
   tokens: how many targets' tokens, and how many of their log-probabilities bit for bit,
   equal their solo run. Off: mlx-lm's own batch rows, as before the mode. On: as the engine
   runs it, the engine's batch rows with decode steps of up to 8 rows compiled, so solo runs
   step compiled and batches of 32 and 128 eagerly (on the CPU, where each row attends alone,
   every step is eager).
3. cost: decode tokens/s at --streams rows, interleaved over --pairs rounds, all warmed:
   mlx-lm's BatchGenerator as loaded (the anchor), the engine's default (its batch rows, steps
   of up to 8 rows compiled) and the engine's deterministic mode (the same, deterministic).
   The medians of the paired ratios deterministic / default (the mode's cost) and default /
   mlx-lm, with their spreads.

    python bench/determinism_bench.py [--model qwen3-0.6b-shape] [--batches 8,32,128]
        [--tokens 256] [--streams 1,8,32,128] [--pairs 3] [--skip-agreement]
        [--probe-zoo qwen3_moe] [--attention auto|alone|chunks]
"""

from __future__ import annotations

import argparse
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

from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from bench.engine_bench import model_spec  # noqa: E402
from engine_service.kv import row_attention_cuda  # noqa: E402
from engine_service.kv.batch_cache import adopt_row  # noqa: E402
from engine_service.loop.compiled_decode import CompiledDecode  # noqa: E402
from engine_service.model import invariant_matmul_cuda  # noqa: E402
from engine_service.model.determinism_probe import check_row_invariant  # noqa: E402
from engine_service.model.deterministic import DeterministicModel  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402
from engine_service.protocol.kv_codec import KVCodec  # noqa: E402
from engine_service.protocol.sampling_options import SamplingOptions  # noqa: E402
from engine_service.sampling.samplers import make_sampler  # noqa: E402

TARGETS = 8
COMPILED_MAX_BATCH = 8  # the engine's default --compiled-decode-max-batch


def engine_side(model: Any, rows: int, kernel: bool, alone: bool | None = None) -> Any:
    """The engine's deterministic model as its scheduler steps it (loop/scheduler.py): small
    batches compiled, except where its rows attend alone (the CPU: every step eager); kernel:
    --deterministic-matmul kernel."""
    deterministic = DeterministicModel(model, rows, kernel, alone)
    return CompiledDecode(deterministic, COMPILED_MAX_BATCH if deterministic.compiles else 0)


def row_caches(model: Any, prompts: list[list[int]]) -> list[list[Any]] | None:
    """The engine's batch rows (kv/batch_cache.py) for a CompiledDecode side; None: mlx-lm's."""
    if not isinstance(model, CompiledDecode):
        return None
    return [[adopt_row(c, KVCodec()) for c in make_prompt_cache(model)] for _ in prompts]


def generate(
    model: Any, prompts: list[list[int]], tokens: int, seeds: list[int] | None, prefill_batch: int
) -> list[tuple[list[int], list[mx.array]]]:
    """Each row's tokens and chosen-token log-probabilities, the rows in one batch (seeds:
    each row's sampling seed; None: greedy)."""
    bg = BatchGenerator(
        model,
        completion_batch_size=max(len(prompts), 1),
        prefill_batch_size=prefill_batch,
        stop_tokens=set(),
    )
    samplers = [
        make_sampler(SamplingOptions(temperature=0.8, seed=seed)) if seeds else None
        for seed in (seeds or [0] * len(prompts))
    ]
    uids = bg.insert(
        prompts,
        max_tokens=[tokens] * len(prompts),
        samplers=samplers,
        caches=row_caches(model, prompts),
    )
    out: dict[int, tuple[list[int], list[mx.array]]] = {u: ([], []) for u in uids}
    done = 0
    while done < len(uids):
        for r in bg.next()[1]:
            out[r.uid][0].append(r.token)
            out[r.uid][1].append(r.logprobs[r.token])
            done += r.finish_reason is not None
    bg.close()
    return [out[u] for u in uids]


def kernel_check() -> None:
    if not row_attention_cuda.AVAILABLE:
        print("kernel check: not MLX-CUDA, skipped (the same algorithm in MLX ops runs instead)")
        return
    rng = mx.random.key(0)
    heads, kv_heads, dim, lengths = 16, 8, 128, [5, 300, 1024, 2047]
    width = max(lengths)
    pads = [width - n for n in lengths]
    q = mx.random.normal((len(lengths), heads, 1, dim), key=rng).astype(mx.bfloat16)
    k = mx.random.normal((len(lengths), kv_heads, width, dim), key=mx.random.key(1))
    v = mx.random.normal((len(lengths), kv_heads, width, dim), key=mx.random.key(2))
    k, v = k.astype(mx.bfloat16), v.astype(mx.bfloat16)
    scale = dim**-0.5
    batched = row_attention_cuda.row_attention(q, k, v, scale, pads)
    worst, invariant = 0.0, 0
    for row, pad in enumerate(pads):
        ref = mx.fast.scaled_dot_product_attention(
            q[row : row + 1], k[row : row + 1, :, pad:], v[row : row + 1, :, pad:], scale=scale
        )
        worst = max(worst, mx.max(mx.abs(ref - batched[row : row + 1])).item())
        alone = row_attention_cuda.row_attention(
            q[row : row + 1], k[row : row + 1, :, pad:], v[row : row + 1, :, pad:], scale, [0]
        )
        invariant += mx.array_equal(alone, batched[row : row + 1]).item()
    # As a compiled step calls it: paddings and the written length as arrays, planes wider.
    wider = [mx.pad(a, [(0, 0), (0, 0), (0, 64), (0, 0)]) for a in (k, v)]
    traced = mx.compile(
        lambda q, k, v, p, n: row_attention_cuda.row_attention(q, k, v, scale, p, n)
    )(q, *wider, mx.array(pads, dtype=mx.int32), mx.array([width], dtype=mx.int32))
    print(
        f"kernel check: max |row_attention - MLX SDPA| {worst:.3g} (bf16);"
        f" rows alone bit-identical to the batch {invariant}/{len(pads)};"
        f" compiled = eager {mx.array_equal(traced, batched).item()}"
    )


def probe(loaded: Any, zoo: list[str], root: Path, kernel: bool) -> None:
    """The start-up probe, as the engine runs it, on this device."""
    from tests.model_zoo import build_zoo_model  # the zoo's tiny shapes of other architectures

    models = [("served model", loaded.model)]
    models += [(arch, load_model(str(build_zoo_model(arch, root)), root).model) for arch in zoo]
    for name, model in models:
        start = time.perf_counter()
        try:
            compiled = check_row_invariant(model, 0, CompiledDecode, kernel)
            if DeterministicModel(model, 1).compiles:
                verdict = f"passes; compiled step = eager step: {compiled}"
            else:
                verdict = "passes; steps eager (each row's attention alone)"
        except ValueError as refused:
            verdict = f"refused: {refused}"
        print(f"probe, {name}: {verdict} ({time.perf_counter() - start:.1f} s)")


def agreement(
    loaded: Any,
    batches: list[int],
    tokens: int,
    kernel: bool,
    alone: bool | None = None,
    modes: tuple[str, ...] = ("off", "on"),
    kinds: tuple[str, ...] = ("greedy", "seeded"),
) -> None:
    rng = random.Random(0)
    vocab = loaded.vocab_size
    targets = [[rng.randrange(3, vocab) for _ in range(16 + 23 * i)] for i in range(TARGETS)]
    for mode in modes:
        model = engine_side(loaded.model, 0, kernel, alone) if mode == "on" else loaded.model
        prefill = 1 if mode == "on" else 8
        for seeded in [kind == "seeded" for kind in kinds]:
            seeds = list(range(1_000, 1_000 + TARGETS)) if seeded else None
            solo = [
                generate(model, [p], tokens, [seeds[i]] if seeds else None, prefill)[0]
                for i, p in enumerate(targets)
            ]
            for size in batches:
                others = [
                    [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 400))]
                    for _ in range(size - TARGETS)
                ]
                # The targets at random places among the others.
                places = sorted(rng.sample(range(size), TARGETS))
                prompts, row_seeds, rest = [], [], iter(others)
                for at in range(size):
                    target = places.index(at) if at in places else -1
                    prompts.append(targets[target] if target >= 0 else next(rest))
                    row_seeds.append(1_000 + target if target >= 0 else 5_000 + at)
                out = generate(model, prompts, tokens, row_seeds if seeded else None, prefill)
                together = [out[at] for at in places]
                same_tokens = sum(a[0] == b[0] for a, b in zip(solo, together, strict=True))
                same_bits = sum(_bit_identical(a, b) for a, b in zip(solo, together, strict=True))
                kind = "seeded" if seeded else "greedy"
                print(
                    f"  mode {mode:3s} {kind:6s} batch {size:3d}: tokens equal solo"
                    f" {same_tokens}/{TARGETS}, log-probs bit-identical {same_bits}/{TARGETS}"
                    f" over {tokens} tokens"
                )


def _bit_identical(
    a: tuple[list[int], list[mx.array]], b: tuple[list[int], list[mx.array]]
) -> bool:
    pairs = zip(a[1], b[1], strict=True)
    return a[0] == b[0] and all(mx.array_equal(x, y).item() for x, y in pairs)


def decode_rate(model: Any, prompts: list[list[int]], tokens: int, prefill: int) -> float:
    """Tokens/s over `tokens` steps with every row decoding (rows join as they prefill)."""
    bg = BatchGenerator(
        model,
        completion_batch_size=len(prompts),
        prefill_batch_size=prefill,
        stop_tokens=set(),
    )
    bg.insert(
        prompts,
        max_tokens=[tokens + len(prompts) + 32] * len(prompts),
        caches=row_caches(model, prompts),
    )
    while len(bg.next()[1]) < len(prompts):  # until the last row has joined
        pass
    produced, start = 0, time.perf_counter()
    for _ in range(tokens):
        produced += len(bg.next()[1])
    seconds = time.perf_counter() - start
    bg.close()
    return produced / seconds


def cost(
    loaded: Any,
    streams: list[int],
    tokens: int,
    pairs: int,
    rows: int,
    kernel: bool,
    alone: bool | None = None,
) -> None:
    rng = random.Random(1)
    sides = {
        "mlx-lm": loaded.model,
        "default": CompiledDecode(loaded.model, COMPILED_MAX_BATCH),
        "deterministic": engine_side(loaded.model, rows, kernel, alone),
    }
    # Rows join 8 at a time on every side. What is timed is decode with every row in; the
    # engine's deterministic mode prefills one row at a time, which is not timed here. And on
    # MLX-CUDA each new batch size compiles kernels: joining one by one to 128 rows took
    # minutes of device time (2026-12-04).
    for n in streams:
        prompts = [[rng.randrange(3, loaded.vocab_size) for _ in range(128)] for _ in range(n)]
        for model in sides.values():  # warm all
            decode_rate(model, prompts, 16, 8)
        rates: dict[str, list[float]] = {name: [] for name in sides}
        for round_ in range(pairs):  # the order turns each round: ABC, BCA, CAB
            names = list(sides)[round_ % 3 :] + list(sides)[: round_ % 3]
            for name in names:
                rates[name].append(decode_rate(sides[name], prompts, tokens, 8))
        cost_ratios = [a / b for a, b in zip(rates["deterministic"], rates["default"], strict=True)]
        anchor = [a / b for a, b in zip(rates["default"], rates["mlx-lm"], strict=True)]
        print(
            f"  {n:3d} streams: mlx-lm {statistics.median(rates['mlx-lm']):8.1f},"
            f" default {statistics.median(rates['default']):8.1f},"
            f" deterministic {statistics.median(rates['deterministic']):8.1f} tok/s;"
            f" deterministic/default {_median_spread(cost_ratios)};"
            f" default/mlx-lm {_median_spread(anchor)}"
        )


def use_transposed_matmuls() -> None:
    """An experiment (--transposed): plain Linear layers in deterministic blocks computed as
    (W @ block^T)^T, a GEMM of another shape for the same fixed block, in case its kernel
    suits one row better."""
    from mlx.nn.layers.linear import Linear

    from engine_service.model import deterministic

    original = Linear.__call__.__wrapped__  # type: ignore[attr-defined]

    def transposed(self: Any, x: mx.array) -> mx.array:
        rows = deterministic.active_rows()
        if not rows or x.ndim != 3 or x.shape[1] != 1:
            return original(self, x)  # type: ignore[no-any-return]

        def call(block: mx.array) -> mx.array:
            y = (self.weight @ block[:, 0, :].T).T[:, None, :]
            return y + self["bias"] if "bias" in self else y

        return deterministic._in_blocks(call, x, rows)

    transposed.__wrapped__ = original  # type: ignore[attr-defined]
    Linear.__call__ = transposed  # type: ignore[method-assign]


def _median_spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--cost-tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--modes", default="off,on", help="agreement with the mode off, on")
    parser.add_argument("--kinds", default="greedy,seeded", help="agreement's sampling kinds")
    parser.add_argument("--rows", type=int, default=0, help="decode matmul block (0: default)")
    parser.add_argument("--kernel", action="store_true", help="--deterministic-matmul kernel")
    parser.add_argument(
        "--attention",
        choices=["auto", "alone", "chunks"],
        default="auto",
        help="--deterministic-attention: rows alone (eager steps) or chunks (compiled steps)",
    )
    parser.add_argument("--probe-zoo", default="", help="zoo shapes to probe, comma-separated")
    parser.add_argument("--transposed", action="store_true", help="an experiment: see below")
    parser.add_argument(
        "--few-row-columns",
        type=int,
        default=0,
        help="an experiment: the kernel's column tiles a block at <= 8 rows (0: as chosen)",
    )
    parser.add_argument(
        "--prefetch",
        action="store_true",
        help="an experiment: the kernel's x loaded with w at <= 8 rows (PREFETCH_AT_FEW_ROWS)",
    )
    args = parser.parse_args()
    if args.prefetch:
        invariant_matmul_cuda.PREFETCH_AT_FEW_ROWS = True
    if args.few_row_columns:
        chosen = invariant_matmul_cuda.column_tiles
        invariant_matmul_cuda.column_tiles = lambda rows, n: (  # type: ignore[assignment]
            args.few_row_columns
            if rows <= invariant_matmul_cuda.FEW_ROWS and n <= invariant_matmul_cuda.VOCABULARY_WIDE
            else chosen(rows, n)
        )
    alone = None if args.attention == "auto" else args.attention == "alone"
    if args.transposed:
        DeterministicModel(mx.array(0))  # the mode's patches go in first, then this over them
        use_transposed_matmuls()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(model_spec(args.model, Path(tmp)), Path(tmp))
        print(f"{args.model} on {mx.default_device()} ({loaded.dtype}), MLX {mx.__version__}")
        probe(loaded, [z for z in args.probe_zoo.split(",") if z], Path(tmp), args.kernel)
    kernel_check()
    if not args.skip_agreement:
        print("agreement with solo runs (8 target rows inside each batch):")
        agreement(
            loaded,
            [int(b) for b in args.batches.split(",")],
            args.tokens,
            args.kernel,
            alone,
            tuple(args.modes.split(",")),
            tuple(args.kinds.split(",")),
        )
    if not args.streams:
        return  # --streams "": the agreement alone
    side = DeterministicModel(loaded.model, args.rows, rows_alone=alone)
    print(
        f"cost, {args.cost_tokens} decode tokens a stream, {args.pairs} ABAB pairs, {side.rows} "
        f"rows, attention {'a row alone' if side.rows_alone else 'in chunks'}:"
    )
    streams = [int(s) for s in args.streams.split(",")]
    cost(loaded, streams, args.cost_tokens, args.pairs, args.rows, args.kernel, alone)


if __name__ == "__main__":
    main()
