"""Speculative decoding: solo greedy tokens/s with and without a draft model, and acceptance.

In one run, for each draft (the small companion, and the target itself as the upper bound
on acceptance), solo and greedy, medians of `--repeat`:
- baseline: mlx-lm's `generate_step` (no draft) and mlx-lm's `speculative_generate_step`;
- ours: `SpeculativeDecoder` in-process, and a Generate stream through a `tandem-engine`
  started with `--draft-model` (num_draft_tokens=k beside num_draft_tokens=0).
Prints decode tokens/s (after the first token), the ratio to plain decoding, and the share of
draft tokens the target kept. Random-weight models agree rarely; the self-draft run shows
what a draft that always agrees buys.

    python bench/speculative_bench.py [--target tandem-tiny --draft tandem-tiny-draft]
        [--target llama3-8b-shape --draft qwen3-0.6b-shape] [--k 4] [--tokens 128]
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step, speculative_generate_step  # noqa: E402
# isort: on

from bench.engine_bench import SHAPES, model_spec  # noqa: E402
from engine_service import blas  # noqa: E402
from engine_service.model import load_model  # noqa: E402
from engine_service.sampling import SamplingOptions  # noqa: E402
from engine_service.speculative import SpeculativeDecoder  # noqa: E402
from tandem_client import EngineClient  # noqa: E402
from tests.servers import start_engine  # noqa: E402

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


def ours(target: Any, draft: Any, prompt: list[int], k: int, n: int) -> tuple[float, float]:
    decoder = SpeculativeDecoder.prefill(target, draft, prompt, SamplingOptions(), [], k)

    def tokens() -> Iterator[int]:
        made = 0
        while made < n:
            for token in decoder.round(n - made).tokens:
                made += 1
                yield token

    rate = decode_rate(tokens(), n)
    return rate, decoder.accepted_total / max(decoder.drafted_total, 1)


def engine_rate(address: str, prompt: list[int], n: int, k: int) -> tuple[float, float]:
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
    p.add_argument("--repeat", type=int, default=3)
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
    }
    with tempfile.TemporaryDirectory(prefix="tandem-spec-bench-") as tmp:
        specs = {
            "target": model_spec(a.target, Path(tmp) / "target"),
            "draft": model_spec(a.draft, Path(tmp) / "draft", {**SHAPES, **DRAFT_SHAPES}),
        }
        target = load_model(specs["target"], Path(tmp))
        drafts = {"draft": load_model(specs["draft"], Path(tmp)), "self": target}
        rng = random.Random(0)
        prompt = [rng.randrange(3, target.vocab_size) for _ in range(a.prompt)]
        n = a.tokens
        x = mx.array(prompt)
        print(
            f"target {a.target}, draft {a.draft}, {target.dtype} on {out['device']}, prompt "
            f"{a.prompt}, {n} tokens, k={a.k}, medians of {a.repeat}"
        )
        # Warm-up: kernels compile on first use.
        list(generate_step(x, target.model, max_tokens=4))
        ours(target.model, drafts["draft"].model, prompt, a.k, 8)
        plain = median_of(
            a.repeat, lambda: decode_rate(generate_step(x, target.model, max_tokens=n), n)
        )
        print(f"  mlx-lm generate_step (no draft): {plain:8.1f} tok/s")
        out["plain_tokens_per_s"] = round(plain, 1)
        engines = {}
        if not a.skip_engine:
            for name, draft_spec in (("draft", specs["draft"]), ("self", specs["target"])):
                engines[name] = start_engine(
                    Path(tmp),
                    "--model",
                    specs["target"],
                    "--draft-model",
                    draft_spec,
                    log_dir=Path(tmp),
                )
        try:
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
                    a.repeat, lambda d=draft: ours(target.model, d.model, prompt, a.k, n)
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
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
