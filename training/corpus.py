"""The training text: the Python standard library's own source (PSF licence).

Every machine that runs Tandem has it, it is code a small model can learn the shape of in
minutes, and its licence allows training on it and shipping excerpts. The files are taken in
sorted order from the running interpreter's stdlib, without tests, IDLE, lib2to3 and
site-packages; a stable hash of each file's path puts 1 in 20 into the held-out split. The
corpus digest is recorded with the weights: another Python 3.11 patch release gives a
slightly different corpus and a loss within the stated tolerance, another minor version
more so (the trainer warns).
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SKIPPED_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo"}
)
HELD_OUT_ONE_IN = 20
SEPARATOR = "<|endoftext|>"  # between files: the model learns where a module ends


@dataclass(frozen=True)
class Corpus:
    train: list[str]  # file texts, in path order
    held_out: list[str]
    digest: str  # of every path and text, in order

    @property
    def train_chars(self) -> int:
        return sum(len(t) for t in self.train)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        if not SKIPPED_DIRS.intersection(path.relative_to(root).parts):
            yield path


def held_out(relative: str) -> bool:
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % HELD_OUT_ONE_IN == 0


def load(root: Path | None = None) -> Corpus:
    root = root or stdlib_dir()
    train: list[str] = []
    held: list[str] = []
    digest = hashlib.sha256()
    for path in source_files(root):
        relative = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files carry other encodings on purpose
        digest.update(relative.encode() + b"\0" + text.encode() + b"\0")
        (held if held_out(relative) else train).append(text)
    return Corpus(train, held, digest.hexdigest()[:16])
