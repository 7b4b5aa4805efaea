"""Speculative decoding: greedy tokens/s with and without a draft model, solo and batched.

In one run, for each draft (the small companion, and the target itself as the upper bound
on acceptance), greedy:
- solo, medians of `--repeat`: baselines mlx-lm's `generate_step` (no draft) and mlx-lm's
  `speculative_generate_step`; ours a `SpeculativeBatch` of one row in-process, and a
  Generate stream through a `tandem-engine` started with `--draft-model`
  (num_draft_tokens=k beside num_draft_tokens=0);
- batched, at each of `--streams` (8 and 32): the baseline is mlx-lm's `BatchGenerator`
  decoding the same prompts without speculation, ours the `SpeculativeBatch` of as many rows
  (every row drafting k); baseline and ours alternate (ABAB) over `--pairs` rounds, and the
  figure is the median of the paired ratios with their spread.
Prints decode tokens/s (after the first token), the ratios, and the share of draft tokens
the target kept. The self-draft run shows what a draft that always agrees buys.

    python bench/speculative_bench.py [--target tandem-tiny --draft tandem-tiny-draft]
        [--target llama3-8b-shape --draft qwen3-0.6b-shape] [--k 4] [--tokens 128]
        [--streams 8,32] [--pairs 3] [--skip-solo] [--skip-engine]
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import (  # noqa: E402
    BatchGenerator,
    generate_step,
    speculative_generate_step,
)
# isort: on

from bench.shapes import SHAPES, model_spec  # noqa: E402
from engine_service import blas  # noqa: E402
from engine_service.loop.compiled_decode import CompiledDecode  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402
from engine_service.protocol.sampling_options import SamplingOptions  # noqa: E402
from engine_service.speculative.batch import SpecRow, SpeculativeBatch, prefilled  # noqa: E402

# A Qwen3-0.6B-shaped draft with the Llama-3 vocabulary size (same tokenizer as the target).
DRAFT_SHAPES = {"qwen3-0.6b-shape": {**SHAPES["qwen3-0.6b-shape"], "vocab_size": 128256}}


def decode_rate(tokens: Iterator[Any], n: int) -> float:
    """Tokens per second after the first token."""
    first = None
    count = 0
    for _ in tokens:
        count += 1
        if first is None:
            first = time.perf_counter()
        if count == n:
            break
    assert first is not None
    return (count - 1) / (time.perf_counter() - first)


@dataclass(frozen=True)
class Variant:
    """How the speculative batch runs: attention over whole planes (wide reads), the draft's
    one-token steps compiled (CompiledDecode, batches up to 8 rows)."""

    wide_reads: bool = False
    compiled_draft: bool = False

    @classmethod
    def parse(cls, name: str) -> Variant:
        parts = set(name.split("+"))
        return cls("wide" in parts, "compiled" in parts)

    @property
    def name(self) -> str:
        return (
            "+".join(
                n for n, on in (("wide", self.wide_reads), ("compiled", self.compiled_draft)) if on
            )
            or "eager"
        )


def speculative_batch(
    target: Any, draft: Any, prompts: list[list[int]], k: int, variant: Variant = Variant()
) -> SpeculativeBatch:
    """Greedy rows drafting k, prefilled (the target holds prompt[:-1], the draft
    prompt[:-2])."""
    stepper = CompiledDecode(draft, 8) if variant.compiled_draft else draft
    batch = SpeculativeBatch(target, stepper, wide_reads=variant.wide_reads)
    for j, prompt in enumerate(prompts):
        row = SpecRow(str(j), list(prompt), 0, k, SamplingOptions())
        batch.add(row, prefilled(target, prompt[:-1]), prefilled(draft, prompt[:-2]))
    return batch


def ours(
    target: Any, draft: Any, prompt: list[int], k: int, n: int, variant: Variant = Variant()
) -> tuple[float, float]:
    batch = speculative_batch(target, draft, [prompt], k, variant)

    def tokens() -> Iterator[int]:
        made = 0
        while made < n:
            (result,) = batch.round([n - made])
            for token in result.tokens:
                made += 1
                yield token

    rate = decode_rate(tokens(), n)
    c = batch.counters
    return rate, c.accepted_total / max(c.drafted_total, 1)


@dataclass
class BatchRun:
    tokens_per_s: float
    tokens: list[list[int]]  # each row's first tokens, for the agreement with plain decoding
    acceptance: float = 0.0


def batch_plain(model: Any, prompts: list[list[int]], n: int) -> BatchRun:
    """mlx-lm's BatchGenerator without speculation: decode tokens/s of every row together,
    after each row's first token, over n steps."""
    bg = BatchGenerator(
        model, completion_batch_size=len(prompts), prefill_batch_size=min(8, len(prompts))
    )
    uids = bg.insert(prompts, max_tokens=[n + 2 * len(prompts) + 8] * len(prompts))
    rows: dict[int, list[int]] = {uid: [] for uid in uids}
    while any(not r for r in rows.values()):  # prefill, until every row has its first token
        for r in bg.next()[1]:
            rows[r.uid].append(r.token)
    tokens = 0
    start = time.perf_counter()
    for _ in range(n):
        responses = bg.next()[1]
        tokens += len(responses)
        for r in responses:
            rows[r.uid].append(r.token)
    wall = time.perf_counter() - start
    bg.close()
    return BatchRun(tokens / wall, [rows[uid] for uid in uids])


def batch_speculative(
    target: Any, draft: Any, prompts: list[list[int]], k: int, n: int, variant: Variant
) -> BatchRun:
    """The SpeculativeBatch of the same rows: decode tokens/s after a first round, until the
    rows made n tokens each on average; acceptance."""
    batch = speculative_batch(target, draft, prompts, k, variant)
    unlimited = [1 << 30] * len(prompts)
    rows = [r.tokens for r in batch.round(unlimited)]  # the first round: first tokens
    made = 0
    start = time.perf_counter()
    while made < n * len(prompts):
        for row, result in zip(rows, batch.round(unlimited), strict=True):
            row += result.tokens
            made += len(result.tokens)
    wall = time.perf_counter() - start
    c = batch.counters
    return BatchRun(made / wall, rows, c.accepted_total / max(c.drafted_total, 1))


def agreement(ours: list[list[int]], plain: list[list[int]]) -> tuple[float, int, float]:
    """(share of rows whose tokens equal plain decoding's over the tokens both made, the
    fewest tokens compared in a row, the median index of a row's first differing token,
    counting an equal row as its compared length)."""
    equal, fewest, firsts = 0, 1 << 30, []
    for mine, theirs in zip(ours, plain, strict=True):
        both = min(len(mine), len(theirs))
        differ = [i for i in range(both) if mine[i] != theirs[i]]
        equal += not differ
        fewest = min(fewest, both)
        firsts.append(differ[0] if differ else both)
    return equal / len(ours), fewest, statistics.median(firsts)


def held_out_windows(length: int) -> list[list[int]]:
    """Windows of held-out Python source (training/corpus.py) in the embedded tokenizer: the
    trained models' own kind of text, which they never saw."""
    from tokenizers import Tokenizer

    from engine_service.model.default_model import TRAINED_DIR
    from training import corpus
    from training.tokenizer import token_stream

    tokenizer = Tokenizer.from_file(str(TRAINED_DIR / "tokenizer.json"))
    stream = token_stream(tokenizer, corpus.load().held_out)
    return [stream[i : i + length] for i in range(0, len(stream) - length, 4 * length)]


def engine_rate(address: str, prompt: list[int], n: int, k: int) -> tuple[float, float]:
    from tandem_client import EngineClient  # the engine runs only here (the device: no grpc)

    with EngineClient(address) as client:
        got = client.generate(prompt, max_tokens=n, ignore_eos=True, num_draft_tokens=k)
    assert got.usage is not None
    u = got.usage
    return u.decode_tokens_per_second, u.accepted_draft_tokens / max(u.draft_tokens, 1)


def median_of(repeat: int, run: Callable[[], Any]) -> Any:
    results = [run() for _ in range(repeat)]
    if isinstance(results[0], tuple):
        return tuple(statistics.median(r[i] for r in results) for i in range(len(results[0])))
    return statistics.median(results)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="tandem-tiny")
    p.add_argument("--draft", default="tandem-tiny-draft")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3, help="solo runs (medians)")
    p.add_argument("--streams", default="8,32", help="batch sizes of the batched runs")
    p.add_argument("--pairs", type=int, default=3, help="ABAB rounds of the batched runs")
    p.add_argument(
        "--variants",
        default="eager",
        help="eager, wide, compiled, wide+compiled (comma; the first also runs solo)",
    )
    p.add_argument(
        "--held-out-prompts",
        action="store_true",
        help="prompts from held-out Python source (the trained models), not random tokens",
    )
    p.add_argument("--skip-solo", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    out: dict[str, Any] = {
        "target": a.target,
        "draft": a.draft,
        "device": str(mx.default_device()),
        "blas": blas.in_use(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {os.cpu_count()} cores",
        "k": a.k,
        "rows": [],
        "batched": [],
    }
    with tempfile.TemporaryDirectory(prefix="tandem-spec-bench-") as tmp:
        specs = {
            "target": model_spec(a.target, Path(tmp) / "target"),
            "draft": model_spec(a.draft, Path(tmp) / "draft", {**SHAPES, **DRAFT_SHAPES}),
        }
        target = load_model(specs["target"], Path(tmp))
        drafts = {"draft": load_model(specs["draft"], Path(tmp)), "self": target}
        rng = random.Random(0)
        prompts_from = held_out_windows(a.prompt) if a.held_out_prompts else None

        def new_prompt() -> list[int]:
            if prompts_from is not None:
                return prompts_from[rng.randrange(len(prompts_from))]
            return [rng.randrange(3, target.vocab_size) for _ in range(a.prompt)]

        prompt = new_prompt()
        print(
            f"target {a.target}, draft {a.draft}, {target.dtype} on {out['device']}, prompt "
            f"{a.prompt}, {a.tokens} tokens, k={a.k}"
        )
        # Warm-up: kernels compile on first use.
        list(generate_step(mx.array(prompt), target.model, max_tokens=4))
        ours(target.model, drafts["draft"].model, prompt, a.k, 8)
        if not a.skip_solo:
            solo(a, specs, target, drafts, prompt, out, Path(tmp))
        for streams in [int(x) for x in a.streams.split(",") if x]:
            prompts = [new_prompt() for _ in range(streams)]
            out["batched"].append(batched(a, target, drafts, prompts))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


def batched(
    a: argparse.Namespace, target: Any, drafts: dict[str, Any], prompts: list[list[int]]
) -> dict[str, Any]:
    """Baseline and speculative batches alternate; the median of paired ratios, and spread."""
    n, streams = a.tokens, len(prompts)
    variants = [Variant.parse(v) for v in a.variants.split(",")]
    cases = [(name, v) for v in variants for name in drafts]
    batch_plain(target.model, prompts, 4)  # warm-up at this batch size
    for name, v in cases:
        batch_speculative(target.model, drafts[name].model, prompts, a.k, 4, v)
    bases: list[BatchRun] = []
    runs: dict[tuple[str, Variant], list[BatchRun]] = {case: [] for case in cases}
    for _ in range(a.pairs):
        bases.append(batch_plain(target.model, prompts, n))
        for name, v in cases:
            runs[(name, v)].append(
                batch_speculative(target.model, drafts[name].model, prompts, a.k, n, v)
            )
    base = statistics.median(b.tokens_per_s for b in bases)
    row: dict[str, Any] = {"streams": streams, "mlx_lm_batch_tokens_per_s": round(base, 1)}
    print(f"  {streams} streams: mlx-lm BatchGenerator (no draft) {base:8.1f} tok/s")
    for (name, v), results in runs.items():
        ratios = [r.tokens_per_s / b.tokens_per_s for r, b in zip(results, bases, strict=True)]
        rate = statistics.median(r.tokens_per_s for r in results)
        accepted = statistics.median(r.acceptance for r in results)
        ratio = statistics.median(ratios)
        equal, compared, first = agreement(results[0].tokens, bases[0].tokens)
        row[f"{name}/{v.name}"] = {
            "tokens_per_s": round(rate, 1),
            "vs_batch": round(ratio, 3),
            "spread": [round(min(ratios), 3), round(max(ratios), 3)],
            "acceptance": round(accepted, 3),
            "rows_equal_to_plain": round(equal, 3),
            "tokens_compared_at_least": compared,
            "median_first_difference": first,
        }
        print(
            f"    draft={name:<5} {v.name:<13} speculative batch {rate:8.1f} tok/s, "
            f"x{ratio:.2f} of the batch "
            f"({min(ratios):.2f}-{max(ratios):.2f}, {a.pairs} pairs), acceptance {accepted:.0%}; "
            f"rows equal to plain decoding {equal:.0%} (over >= {compared} tokens; "
            f"first difference at token {first:g}, median)"
        )
    return row


def solo(
    a: argparse.Namespace,
    specs: dict[str, Any],
    target: Any,
    drafts: dict[str, Any],
    prompt: list[int],
    out: dict[str, Any],
    tmp: Path,
) -> None:
    """One stream: mlx-lm's plain and speculative decoding, ours in process and the engine's."""
    n = a.tokens
    x = mx.array(prompt)
    variant = Variant.parse(a.variants.split(",")[0])
    plain = median_of(
        a.repeat, lambda: decode_rate(generate_step(x, target.model, max_tokens=n), n)
    )
    print(f"  solo: mlx-lm generate_step (no draft): {plain:8.1f} tok/s")
    out["plain_tokens_per_s"] = round(plain, 1)
    engines = {}
    if not a.skip_engine:
        from tests.servers import start_engine

        for name, draft_spec in (("draft", specs["draft"]), ("self", specs["target"])):
            engines[name] = start_engine(
                tmp, "--model", specs["target"], "--draft-model", draft_spec, log_dir=tmp
            )
    try:
        engine_plain = 0.0
        if engines:
            address = engines["draft"].address
            engine_rate(address, prompt, 8, a.k)
            engine_plain = median_of(a.repeat, lambda: engine_rate(address, prompt, n, 0))[0]
            print(f"  engine, num_draft_tokens=0:      {engine_plain:8.1f} tok/s")
            out["engine_plain_tokens_per_s"] = round(engine_plain, 1)
        for name, draft in drafts.items():
            theirs = median_of(
                a.repeat,
                lambda d=draft: decode_rate(
                    speculative_generate_step(
                        x, target.model, d.model, num_draft_tokens=a.k, max_tokens=n
                    ),
                    n,
                ),
            )
            rate, accepted = median_of(
                a.repeat,
                lambda d=draft: ours(target.model, d.model, prompt, a.k, n, variant),
            )
            row = {
                "draft": name,
                "mlx_lm_speculative_tokens_per_s": round(theirs, 1),
                "ours_tokens_per_s": round(rate, 1),
                "ours_vs_plain": round(rate / plain, 3),
                "mlx_lm_speculative_vs_plain": round(theirs / plain, 3),
                "acceptance": round(accepted, 3),
            }
            print(
                f"  draft={name:<5} mlx-lm speculative {theirs:8.1f} tok/s "
                f"(x{theirs / plain:.2f}), ours {rate:8.1f} tok/s (x{rate / plain:.2f}), "
                f"acceptance {accepted:.0%}"
            )
            if name in engines:
                address = engines[name].address
                engine_rate(address, prompt, 8, a.k)
                e_rate, e_acc = median_of(
                    a.repeat, lambda ad=address: engine_rate(ad, prompt, n, a.k)
                )
                row["engine_tokens_per_s"] = round(e_rate, 1)
                row["engine_vs_engine_plain"] = round(e_rate / engine_plain, 3)
                print(
                    f"               engine {e_rate:8.1f} tok/s "
                    f"(x{e_rate / engine_plain:.2f} of the engine without a draft), "
                    f"acceptance {e_acc:.0%}"
                )
            out["rows"].append(row)
    finally:
        for proc in engines.values():
            proc.stop()


if __name__ == "__main__":
    main()
