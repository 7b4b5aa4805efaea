"""Where a row's bits first depend on its batch, op by op (issue 39).

Runs one target row alone (a batch of 1) and inside batches of 2..N rows of other prompts,
with mlx-lm's own batch cache (left padding, as BatchGenerator builds it), and records every
op's output on the target row: the embedding, each projection, norm and attention, the
logits. The batched runs are teacher-forced with the solo run's greedy tokens, so every
step compares the same inputs. For the prefill and each decode step it prints the first op
whose output on the target row is not bit-identical to the solo run, and how many ops
differ.

    python bench/batch_invariance.py [--model tandem-tiny] [--batches 2,8,32] [--steps 8]
        [--deterministic] [--json OUT]

--deterministic runs the model under engine_service/model/deterministic.py, the engine's
--deterministic mode, whose aim is that nothing here differs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
# isort: on

from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

from bench.engine_bench import model_spec  # noqa: E402
from engine_service.model.deterministic import deterministic  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402

PROBED = (nn.Linear, nn.QuantizedLinear, nn.RMSNorm, nn.LayerNorm, nn.Embedding)


class Probe:
    """Stands in for a module: calls it and keeps its output, named, in call order."""

    def __init__(self, module: Any, name: str, records: list[tuple[str, mx.array]]) -> None:
        self.module, self.name, self.records = module, name, records

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        self.records.append((self.name, out))
        return out

    def as_linear(self, x: mx.array) -> mx.array:  # a tied embedding's logits
        out = self.module.as_linear(x)
        self.records.append(("logits (tied embedding)", out))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)


def install_probes(model: Any, records: list[tuple[str, mx.array]]) -> None:
    """Wraps every projection, norm and embedding, and the model's attention function."""

    def walk(node: Any, prefix: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in list(items):
            name = f"{prefix}{key}"
            if isinstance(child, PROBED):
                node[key] = Probe(child, name, records)
            elif isinstance(child, (nn.Module, list)):
                walk(child, name + ".")

    walk(model, "")
    module = sys.modules[type(model).__module__]
    attention = module.scaled_dot_product_attention

    def probed_attention(*args: Any, **kwargs: Any) -> mx.array:
        out = attention(*args, **kwargs)
        records.append(("attention", out))
        return out

    module.scaled_dot_product_attention = probed_attention


def forward(model: Any, tokens: list[list[int]], caches: list[Any], records: list) -> mx.array:
    records.clear()
    logits = model(mx.array(tokens), cache=caches)
    mx.eval(logits, [r[1] for r in records])
    return logits


def left_padded(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    return [[0] * pad + p for pad, p in zip(pads, prompts, strict=True)], pads


@dataclass
class PhaseResult:
    batch: int
    phase: str  # "prefill" or "decode N"
    ops: int
    differing_ops: int
    first_differing_op: str
    max_abs_difference: float
    logits_equal: bool


def target_slice(out: mx.array, row: int, pad: int, name: str) -> mx.array:
    if name == "attention":  # (batch, heads, tokens, dim)
        return out[row, :, pad:]
    return out[row, pad:]


def run(
    model: Any,
    records: list,
    prompts: list[list[int]],
    target: int,
    forced: list[int],
    rows_alone: bool,
) -> list[list[tuple[str, mx.array]]]:
    """Each phase's records on the target row: the prefill, then one per forced token.

    rows_alone: each row is prefilled alone, then the rows join one batch (as the engine
    does in deterministic mode); else all are prefilled together, left-padded."""
    phases = []
    if rows_alone:
        per_row = []
        for row, prompt in enumerate(prompts):
            own = make_prompt_cache(model)
            forward(model, [prompt], own, records)
            if row == target:
                phases.append([(n, o[0]) for n, o in records])
            per_row.append(own)
        first = per_row[0]
        caches = [first[layer].merge([c[layer] for c in per_row]) for layer in range(len(first))]
    else:
        padded, pads = left_padded(prompts)
        caches = [BatchKVCache(pads) for _ in range(len(model.layers))]
        forward(model, padded, caches, records)
        phases.append([(n, target_slice(o, target, pads[target], n)) for n, o in records])
    for token in forced:
        step = [[token] for _ in prompts]
        forward(model, step, caches, records)
        phases.append([(n, target_slice(o, target, 0, n)) for n, o in records])
    return phases


def compare(
    batch: int, solo: list[list[tuple[str, mx.array]]], other: list[list[tuple[str, mx.array]]]
) -> list[PhaseResult]:
    results = []
    for index, (a, b) in enumerate(zip(solo, other, strict=True)):
        if [n for n, _ in a] != [n for n, _ in b]:  # the same model, the same ops
            raise RuntimeError("the runs recorded different ops")
        differing = [
            (na, float(mx.max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32))).item()))
            for (na, x), (_, y) in zip(a, b, strict=True)
            if not mx.array_equal(x, y).item()
        ]
        phase = "prefill" if index == 0 else f"decode {index}"
        results.append(
            PhaseResult(
                batch,
                phase,
                len(a),
                len(differing),
                differing[0][0] if differing else "",
                max((d for _, d in differing), default=0.0),
                mx.array_equal(a[-1][1], b[-1][1]).item(),
            )
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--batches", default="2,8,32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(model_spec(args.model, Path(tmp)), Path(tmp))
    model = deterministic(loaded.model) if args.deterministic else loaded.model
    records: list[tuple[str, mx.array]] = []
    install_probes(model.model if hasattr(model, "model") else model, records)
    rng = random.Random(0)
    vocab = loaded.vocab_size
    target = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
    # The solo run's greedy tokens feed every run.
    solo_caches = [BatchKVCache([0]) for _ in range(len(model.layers))]
    logits = forward(model, [target], solo_caches, records)
    forced = []
    for _ in range(args.steps):
        forced.append(int(mx.argmax(logits[0, -1]).item()))
        logits = forward(model, [[forced[-1]]], solo_caches, records)
    solo = run(model, records, [target], 0, forced, args.deterministic)
    results: list[PhaseResult] = []
    for batch in [int(b) for b in args.batches.split(",")]:
        others = [
            [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 2 * args.prompt_tokens))]
            for _ in range(batch - 1)
        ]
        at = rng.randrange(batch)
        prompts = others[:at] + [target] + others[at:]
        batched = run(model, records, prompts, at, forced, args.deterministic)
        results += compare(batch, solo, batched)
    mode = "deterministic" if args.deterministic else "default"
    print(f"{args.model} on {mx.default_device()} ({loaded.dtype}), {mode} mode:")
    for r in results:
        where = r.first_differing_op or "-"
        print(
            f"  batch {r.batch:3d} {r.phase:9s}: {r.differing_ops:3d}/{r.ops} ops differ,"
            f" first {where}, max |diff| {r.max_abs_difference:.3g},"
            f" logits {'equal' if r.logits_equal else 'DIFFER'}"
        )
    equal = sum(r.logits_equal for r in results)
    print(f"logits bit-identical to the solo run in {equal}/{len(results)} phases")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
