"""`python -m training`: trains the tokenizer and the embedded models, or checks a rerun.

python -m training                       # writes engine_service/model/default_model/trained/
python -m training --out /tmp/t --check  # retrains elsewhere, compares with the committed
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

import engine_service  # noqa: F401 - picks a fast BLAS before mlx is imported
from engine_service.model.default_model import TRAINED_DIR, TRAINED_MODELS
from training import corpus, ranks
from training.tokenizer import token_stream, train_tokenizer
from training.train import Recipe, Report, elapsed_since, environment, save_weights, train

# A rerun's held-out loss may differ from the committed one by this much (nats): float32
# reductions in another order (another BLAS, thread count or device) change the trajectory
# a little; another corpus (another Python) a little more.
TOLERANCE = 0.08


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    parser.add_argument("--out", type=Path, default=TRAINED_DIR)
    parser.add_argument("--models", default=",".join(TRAINED_MODELS))
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--batch", type=int, default=Recipe.batch, help="windows a step")
    parser.add_argument("--context", type=int, default=Recipe.context, help="tokens a window")
    parser.add_argument(
        "--check", action="store_true", help="compare with the committed training reports"
    )
    parser.add_argument(
        "--prepare", action="store_true", help="only write the tokenizer and token streams"
    )
    parser.add_argument(
        "--streams", type=Path, help="train on the tokenizer and streams --prepare wrote there"
    )
    parser.add_argument("--device", choices=("default", "cpu", "gpu"), default="default")
    parser.add_argument(
        "--ranks",
        type=int,
        help="data-parallel processes (training/ranks.py); default: 2 on a CPU of 2+ cores",
    )
    args = parser.parse_args(argv)
    group = ranks.joined_group()
    count = args.ranks if args.ranks is not None else ranks.default_ranks(args.device)
    if group is None and count > 1 and not args.prepare:
        return _launch(args, count)
    if args.device != "default":
        import mlx.core as mx

        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    args.out.mkdir(parents=True, exist_ok=True)
    leader = ranks.is_leader()
    log = print if leader else (lambda *_: None)

    if args.streams is not None:  # prepared elsewhere (--prepare): the same tokens exactly
        data = np.load(args.streams / "streams.npz")
        train_ids, held_ids = data["train"].astype(np.int32), data["held_out"].astype(np.int32)
        digest = str(data["digest"])
        if leader:
            shutil.copy(args.streams / "tokenizer.json", args.out / "tokenizer.json")
    else:
        text = corpus.load()
        digest = text.digest
        print(f"corpus {digest}: {len(text.train)} files, {text.train_chars / 1e6:.1f} M chars")
        tokenizer = train_tokenizer(text.train)
        tokenizer.save(str(args.out / "tokenizer.json"))
        train_ids = np.array(token_stream(tokenizer, text.train), dtype=np.int32)
        held_ids = np.array(token_stream(tokenizer, text.held_out), dtype=np.int32)
    log(f"{len(train_ids):,} training tokens, {len(held_ids):,} held out")
    if args.prepare:
        np.savez_compressed(
            args.out / "streams.npz",
            train=train_ids.astype(np.uint16),
            held_out=held_ids.astype(np.uint16),
            digest=np.array(digest),
        )
        return 0

    failures = 0
    for name in args.models.split(","):
        recipe = replace(
            Recipe(), model=name, steps=args.steps, batch=args.batch, context=args.context
        )
        start = time.monotonic()
        model, _, train_loss, held = train(recipe, train_ids, held_ids, log, group)
        if not leader:
            continue
        python, mlx_version, device = environment()
        report = Report(
            recipe,
            digest,
            len(train_ids),
            recipe.steps * recipe.batch * recipe.context,
            round(train_loss, 4),
            round(held, 4),
            round(float(np.exp(held)), 2),
            elapsed_since(start),
            python,
            mlx_version,
            device,
            1 if group is None else group.size(),
        )
        save_weights(model, args.out / f"{name}.safetensors")
        (args.out / f"{name}.json").write_text(report.to_json())
        print(f"{name}: held-out loss {held:.3f} ({report.seconds} s)")
        if args.check:
            failures += not _matches(name, report)
    return 1 if failures else 0


def _launch(args: argparse.Namespace, count: int) -> int:
    """Prepares the token streams once, then trains on them in `count` rank processes."""
    with tempfile.TemporaryDirectory(prefix="tandem-streams-") as scratch:
        streams = args.streams
        if streams is None:
            streams = Path(scratch)
            main(["--prepare", "--out", str(streams)])
        argv = ["--out", str(args.out), "--models", args.models, "--steps", str(args.steps)]
        argv += ["--batch", str(args.batch), "--context", str(args.context)]
        argv += ["--streams", str(streams), "--device", args.device]
        print(f"training in {count} ranks (training/ranks.py)")
        return ranks.launch(count, argv + (["--check"] if args.check else []))


def _matches(name: str, report: Report) -> bool:
    committed = json.loads((TRAINED_DIR / f"{name}.json").read_text())
    if committed["corpus_digest"] != report.corpus_digest:
        print(f"note: another corpus than the committed run's ({committed['corpus_digest']})")
    difference = abs(committed["held_out_loss"] - report.held_out_loss)
    ok = bool(difference <= TOLERANCE)
    print(
        f"{name}: held-out loss {report.held_out_loss} against the committed "
        f"{committed['held_out_loss']} (tolerance {TOLERANCE}): {'ok' if ok else 'DIFFERS'}"
    )
    return ok


if __name__ == "__main__":
    sys.exit(main())
