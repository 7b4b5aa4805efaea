"""What KV codecs cost in quality, on the trained default model (docs/kv_quantization.md).

Teacher-forced held-out Python (training/corpus.py's held-out files): each window's first
`--prompt` tokens are prefilled, then every later token is fed one decode step at a time
through the engine's own batch cache (BatchQuantizedKVCache, the rows the scheduler builds
for a request's codec), so each step attends over KV stored in that codec, as in serving.
Printed per codec: held-out perplexity, its ratio to plain KV's, the share of positions
whose top-1 token equals plain KV's, and the mean KL divergence from plain KV's next-token
distribution.

    python bench/kv_quality.py [--windows 2] [--prompt 256] [--length 768]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from engine_service.model.default_model import TRAINED_DIR, ensure_model  # noqa: E402
from engine_service.protocol.kv_codec import PLAIN_KV, KVCodec  # noqa: E402
from engine_service.kv import attention_routing  # noqa: E402, F401
from engine_service.kv import batch_cache  # noqa: E402, F401
from engine_service.kv.rows import adopt_row  # noqa: E402
from training import corpus  # noqa: E402
from training.tokenizer import token_stream  # noqa: E402
# isort: on

CODECS: dict[str, KVCodec] = {
    "plain": PLAIN_KV,
    "affine 8-bit": KVCodec(8),
    "affine 4-bit": KVCodec(4),
    "TurboQuant 4/4": KVCodec.turboquant(4, 4),
    "TurboQuant 4/2": KVCodec.turboquant(4, 2),
    "TurboQuant 3/3": KVCodec.turboquant(3, 3),
    "TurboQuant 2/2": KVCodec.turboquant(2, 2),
}


@dataclass
class Forced:
    logprobs: list[np.ndarray]  # per measured position, the next-token log-distribution
    targets: list[int]


def forced(model: object, tokens: np.ndarray, prompt: int, codec: KVCodec) -> Forced:
    rows = [adopt_row(c, codec) for c in make_prompt_cache(model)]
    logits = model(mx.array(tokens[None, :prompt]), cache=rows)  # type: ignore[operator]
    caches = [type(r).merge([r]) for r in rows]  # as BatchGenerator merges a new row
    out = Forced([], [])
    last = logits[:, -1, :]
    for k in range(prompt, len(tokens)):
        out.logprobs.append(np.array(last[0] - mx.logsumexp(last[0]), dtype=np.float64))
        out.targets.append(int(tokens[k]))
        last = model(mx.array([[int(tokens[k])]]), cache=caches)[:, -1, :]  # type: ignore[operator]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--length", type=int, default=768)
    parser.add_argument("--data-dir", type=Path, default=ROOT / ".tandem")
    args = parser.parse_args()
    model = load(str(ensure_model("tandem-tiny", args.data_dir / "models")))[0]
    attention_routing.install()  # TurboQuant rows' attention, as the engine's loader does
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TRAINED_DIR / "tokenizer.json"))
    stream = np.array(token_stream(tokenizer, corpus.load().held_out), dtype=np.int32)
    starts = np.linspace(0, len(stream) - args.length - 1, args.windows).astype(int)
    windows = [stream[s : s + args.length] for s in starts]
    runs = {name: [forced(model, w, args.prompt, c) for w in windows] for name, c in CODECS.items()}
    plain = [lp for run in runs["plain"] for lp in run.logprobs]
    targets = [t for run in runs["plain"] for t in run.targets]
    plain_ppl = float(np.exp(-np.mean([lp[t] for lp, t in zip(plain, targets, strict=True)])))
    positions = len(targets)
    print(f"{args.windows} windows x {args.length - args.prompt} forced positions ({positions})")
    print(f"{'codec':16} {'perplexity':>10} {'vs plain':>9} {'top-1 = plain':>14} {'KL':>9}")
    for name, codec_runs in runs.items():
        ours = [lp for run in codec_runs for lp in run.logprobs]
        nll = -np.mean([lp[t] for lp, t in zip(ours, targets, strict=True)])
        agree = np.mean([np.argmax(a) == np.argmax(b) for a, b in zip(ours, plain, strict=True)])
        kl = np.mean([np.sum(np.exp(p) * (p - q)) for p, q in zip(plain, ours, strict=True)])
        ppl = float(np.exp(nll))
        print(f"{name:16} {ppl:10.2f} {ppl / plain_ppl:9.3f} {agree:14.3f} {kl:9.4f}")


if __name__ == "__main__":
    main()
