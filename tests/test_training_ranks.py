"""Data-parallel training (training/ranks.py): two rank processes joined over loopback take
the same steps as one process, summed in another order, and a failing rank stops the run
with its status."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from engine_service.model.default_model import TRAINED_DIR

ROOT = Path(__file__).resolve().parent.parent


def _streams(directory: Path) -> Path:
    """Token streams in --prepare's format, drawn from a seeded generator (the trainer does
    not care what the tokens mean)."""
    directory.mkdir()
    rng = np.random.default_rng(7)
    np.savez_compressed(
        directory / "streams.npz",
        train=rng.integers(3, 2048, 40_000).astype(np.uint16),
        held_out=rng.integers(3, 2048, 20_000).astype(np.uint16),
        digest=np.array("synthetic"),
    )
    shutil.copy(TRAINED_DIR / "tokenizer.json", directory / "tokenizer.json")
    return directory


def _train(streams: Path, out: Path, ranks: int) -> dict[str, float]:
    command = [sys.executable, "-m", "training", "--streams", str(streams), "--out", str(out)]
    command += ["--models", "tandem-tiny-draft", "--steps", "3", "--ranks", str(ranks)]
    command += ["--batch", "8", "--context", "64"]  # the split, not the model, is the point
    subprocess.run(command, check=True, cwd=ROOT, timeout=600, capture_output=True)
    report: dict[str, float] = json.loads((out / "tandem-tiny-draft.json").read_text())
    return report


def test_two_ranks_take_the_steps_one_process_takes(tmp_path: Path) -> None:
    streams = _streams(tmp_path / "streams")
    alone = _train(streams, tmp_path / "alone", 1)
    split = _train(streams, tmp_path / "split", 2)
    assert (alone["ranks"], split["ranks"]) == (1, 2)
    # The same windows and the same averaged gradient: equal up to float32 summation order.
    assert abs(alone["train_loss"] - split["train_loss"]) < 1e-3
    assert abs(alone["held_out_loss"] - split["held_out_loss"]) < 1e-3
    assert (tmp_path / "split" / "tandem-tiny-draft.safetensors").stat().st_size > 0


def test_a_rank_that_fails_ends_the_run_with_its_status(tmp_path: Path) -> None:
    """A batch that does not split over the ranks fails in the ranks; the launcher returns
    a failing status, and the reason is printed."""
    streams = _streams(tmp_path / "streams")
    command = [sys.executable, "-m", "training", "--streams", str(streams)]
    command += ["--out", str(tmp_path / "out"), "--models", "tandem-tiny-draft"]
    command += ["--steps", "2", "--ranks", "3", "--batch", "8"]  # 8 windows over 3 ranks
    done = subprocess.run(command, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert done.returncode != 0
    assert "a batch of 8 does not split over 3 ranks" in done.stderr
