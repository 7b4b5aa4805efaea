"""Compressed prefix records (checkpoints/record_codec.py): bytes, restore time and quality,
each beside the exact record, on the trained default model.

For each held-out window (training/corpus.py) the first --prompt tokens are prefilled and
captured as a prefix record: exact, 8-bit and 4-bit affine, 4- and 3-bit TurboQuant. Each
record goes to host tensors (the bytes a store hit moves) and is restored as the engine
restores one (`restore`: host bytes -> MLX arrays, codes expanded on the device). From each
restored prefix the next tokens are teacher-forced with plain KV; printed per record: its
bytes, the median restore time of interleaved repeats (exact, 8, 4, tq-4, tq-3, exact, ...)
and the median of its paired ratios to the exact record's, the held-out perplexity, the share
of positions whose top-1 token equals the exact prefix's, and the mean KL divergence from the
exact prefix's next-token distribution.

    python bench/record_codec_bench.py [--windows 4] [--prompt 1024] [--length 1280]
    python bench/record_codec_bench.py --model qwen3-0.6b-shape --prompt 8192 --no-quality

A shape (bench/shapes.py) has random weights: its windows are random tokens, and only bytes
and restore times mean something (--no-quality skips the forced decoding).
"""

from __future__ import annotations

import argparse
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
import numpy as np  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from engine_service.checkpoints.cache_records import capture, restore, to_host  # noqa: E402
from engine_service.checkpoints.record_codec import compress  # noqa: E402
from engine_service.model.loading import load_model  # noqa: E402
from engine_service.protocol.kv_codec import Scheme  # noqa: E402
from engine_service.protocol.requests import EXACT_RECORD, RecordFormat  # noqa: E402
from bench.shapes import model_spec  # noqa: E402
from engine_service.model.default_model import TRAINED_DIR, ensure_model  # noqa: E402
from training import corpus  # noqa: E402
from training.tokenizer import token_stream  # noqa: E402
# isort: on

RECORDS = {
    "exact": EXACT_RECORD,
    "8-bit": RecordFormat(8),
    "4-bit": RecordFormat(4),
    "tq-4": RecordFormat(4, Scheme.TURBOQUANT),
    "tq-3": RecordFormat(3, Scheme.TURBOQUANT),
}


def forced_logprobs(model, caches, tokens: np.ndarray) -> list[np.ndarray]:  # noqa: ANN001
    """Next-token log-distributions over `tokens`, fed one decode step at a time."""
    out = []
    for k in range(len(tokens) - 1):
        logits = model(mx.array([[int(tokens[k])]]), cache=caches)[0, -1]
        out.append(np.array(logits - mx.logsumexp(logits), dtype=np.float64))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--length", type=int, default=1280)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--data-dir", type=Path, default=ROOT / ".tandem")
    parser.add_argument("--model", default="tandem-tiny")
    parser.add_argument("--no-quality", action="store_true")
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="tandem-record-bench-")
    if args.model == "tandem-tiny":
        model = load(str(ensure_model("tandem-tiny", args.data_dir / "models")))[0]
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(TRAINED_DIR / "tokenizer.json"))
        stream = np.array(token_stream(tokenizer, corpus.load().held_out), dtype=np.int32)
    else:  # random weights: random tokens
        loaded = load_model(model_spec(args.model, Path(scratch.name)), Path(scratch.name))
        model = loaded.model
        rng = np.random.default_rng(0)
        stream = rng.integers(0, loaded.vocab_size, args.windows * args.length + 1).astype(np.int32)
    starts = np.linspace(0, len(stream) - args.length - 1, args.windows).astype(int)
    nbytes: dict[str, int] = {}
    times: dict[str, list[float]] = {name: [] for name in RECORDS}
    runs: dict[str, list[np.ndarray]] = {name: [] for name in RECORDS}
    targets: list[int] = []
    for start in starts:
        window = stream[start : start + args.length]
        caches = make_prompt_cache(model)
        model(mx.array(window[None, : args.prompt - 1]), cache=caches)
        exact = capture(caches, args.prompt - 1)
        records = {name: compress(exact, form) for name, form in RECORDS.items()}
        hosted = {name: to_host(record) for name, record in records.items()}
        for r in range(args.repeat + 1):  # interleaved; the first round warms up
            for name, record in records.items():
                begin = time.perf_counter()
                restored = restore(record.meta(), hosted[name], record.layout)
                mx.eval([c.state for c in restored])
                if r:
                    times[name].append(time.perf_counter() - begin)
        for name, record in records.items():
            nbytes[name] = record.nbytes
            if not args.no_quality:
                restored = restore(record.meta(), hosted[name], record.layout)
                runs[name] += forced_logprobs(model, restored, window[args.prompt - 1 :])
        targets += [int(t) for t in window[args.prompt :]]
    exact_runs = runs["exact"]
    print(
        f"{args.model} on {mx.default_device()}: {args.windows} windows, prefix {args.prompt} "
        f"tokens, {len(targets)} forced positions, restore medians of {args.repeat} rounds"
    )
    print(
        f"{'record':8} {'bytes':>10} {'vs exact':>8} {'restore ms':>10} {'vs exact':>8} "
        f"{'perplexity':>10} {'top-1 = exact':>13} {'KL':>8}"
    )
    for name, ours in runs.items():
        nll = agree = kl = float("nan")
        if not args.no_quality:
            nll = -np.mean([lp[t] for lp, t in zip(ours, targets, strict=True)])
            pairs = list(zip(ours, exact_runs, strict=True))
            agree = np.mean([np.argmax(a) == np.argmax(b) for a, b in pairs])
            kl = np.mean([np.sum(np.exp(q) * (q - p)) for p, q in pairs])
        restore_s = statistics.median(times[name])
        paired = [a / b for a, b in zip(times[name], times["exact"], strict=True)]
        print(
            f"{name:8} {nbytes[name]:10,} {nbytes[name] / nbytes['exact']:8.3f} "
            f"{restore_s * 1e3:10.2f} {statistics.median(paired):8.2f} {np.exp(nll):10.3f} "
            f"{agree:13.3f} {kl:8.5f}   (restore ratio spread {min(paired):.2f}-{max(paired):.2f})"
        )


if __name__ == "__main__":
    main()
