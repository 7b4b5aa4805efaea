"""Token-mask time on a real 131k vocabulary: Mistral's Tekken tokenizer, the data file
that mistral-common ships on PyPI (no model weights needed: a mask depends on the vocabulary
and the grammar only).

The shaped models of the engine benches carry the tiny 2,048-token tokenizer, so their mask
times are a small vocabulary's. This times what a step of R constrained rows costs the host
on a real one: R masks one after another (the per-row processors' way, the baseline) beside
R masks from llguidance's LLExecutor in parallel (BatchMasks' way), for a JSON schema with
free strings (where most tokens stay allowed), a regex, and a regex of a bounded repetition
(the costly case). Each row walks its grammar at random; the figures are medians over the
steps. LLExecutor uses 80% of the cores (one thread on 2 cores).

    python bench/vocab_masks.py [--tekken auto|PATH(.json|.json.xz)] [--rows 32] [--steps 200]
"""

from __future__ import annotations

import argparse
import base64
import json
import lzma
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "city", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[A-Za-z][A-Za-z ,.]*"
# A bounded repetition: each count is a lexer state of its own, so masks are not reused from
# state to state (the worst case; the engine bench's fixed-length regex is of this kind).
BOUNDED = r"[A-Za-z ,.]{20,400}"
MISTRAL_COMMON = "mistral-common==1.13.1"
TEKKEN = "mistral_common/data/tekken_240911.json"


def tekken_file(spec: str, into: Path) -> Path:
    """The Tekken JSON: a path, or 'auto' to take it from mistral-common's wheel (PyPI)."""
    if spec != "auto":
        return Path(spec)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(into),
         MISTRAL_COMMON],
        check=True,
    )  # fmt: skip
    wheel = next(into.glob("mistral_common-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extract(TEKKEN, into)
    return into / TEKKEN


@dataclass(frozen=True)
class Tekken:
    """Tekken's tokens by id (its 1,000 special tokens first, then the byte-level ranks) and
    its pre-tokenizer pattern."""

    tokens: list[bytes]
    specials: int
    pattern: str


def read_tekken(path: Path) -> Tekken:
    raw = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    data = json.loads(raw)
    config = data["config"]
    specials = config["default_num_special_tokens"]
    tokens = [f"<SPECIAL_{i}>".encode() for i in range(specials)]
    tokens += [b""] * (config["default_vocab_size"] - specials)
    for entry in data["vocab"][: len(tokens) - specials]:
        tokens[entry["rank"] + specials] = base64.b64decode(entry["token_bytes"])
    return Tekken(tokens, specials, config["pattern"])


def tekken_tokenizer(tekken: Tekken) -> Any:
    """llguidance's tokenizer for Tekken (EOS is token 2)."""
    from llguidance import LLTokenizer

    ranks = {token: i for i, token in enumerate(tekken.tokens) if i >= tekken.specials}
    special = {tekken.tokens[i].decode(): i for i in range(tekken.specials)}
    return LLTokenizer.from_tiktoken(
        encoder=ranks, special_tokens=special, pattern=tekken.pattern, eos_token=2,
        n_vocab=len(tekken.tokens),
    )  # fmt: skip


def _walk(tokenizer: Any, grammar: str, rows: int, steps: int, n_vocab: int) -> dict[str, float]:
    """Two sets of matchers fed the same tokens: set A's masks one by one, set B's together
    (a matcher keeps the mask of its state, so one set timed both ways would favour the
    second)."""
    from llguidance import LLExecutor, LLMatcher

    words = (n_vocab + 31) // 32
    executor = LLExecutor()
    sets = [[LLMatcher(tokenizer, grammar, log_level=0) for _ in range(rows)] for _ in "AB"]
    masks = [np.zeros((rows, words), dtype=np.int32) for _ in "AB"]
    rng = np.random.default_rng(0)
    one_by_one: list[float] = []
    together: list[float] = []

    def by_one() -> None:
        t = time.perf_counter()
        for i, m in enumerate(sets[0]):
            m.unsafe_compute_mask_ptr(masks[0][i].ctypes.data, words * 4)
        one_by_one.append(time.perf_counter() - t)

    def at_once() -> None:
        pairs = [(m, i) for i, m in enumerate(sets[1])]
        t = time.perf_counter()
        executor.unsafe_compute_mask_ptr(pairs, masks[1].ctypes.data, words * 4, rows)
        together.append(time.perf_counter() - t)

    for step in range(steps):
        for way in (by_one, at_once) if step % 2 == 0 else (at_once, by_one):  # ABAB
            way()
        assert np.array_equal(masks[0], masks[1])
        for i in range(rows):
            bits = np.unpackbits(masks[0][i].view(np.uint8), bitorder="little")[:n_vocab]
            allowed = np.flatnonzero(bits)
            choices = allowed[allowed != 2] if len(allowed) > 1 else allowed
            token = int(rng.choice(choices))
            fed = [m[i].consume_token(token) and not m[i].is_stopped() for m in sets]
            if token == 2 or not all(fed):
                for m in sets:  # start the row again
                    m[i] = LLMatcher(tokenizer, grammar, log_level=0)
    seq, par = statistics.median(one_by_one), statistics.median(together)
    ratios = [a / b for a, b in zip(one_by_one, together, strict=True)]
    return {
        "one_mask_us": seq / rows * 1e6,
        "rows_one_by_one_ms": seq * 1e3,
        "rows_together_ms": par * 1e3,
        "speedup_median": statistics.median(ratios),
        "speedup_min": min(ratios),
        "speedup_max": max(ratios),
    }


def run(spec: str, rows: int, steps: int) -> dict[str, dict[str, float]]:
    from llguidance import LLMatcher

    with tempfile.TemporaryDirectory(prefix="tandem-tekken-") as tmp:
        tekken = read_tekken(tekken_file(spec, Path(tmp)))
    tokenizer, n_vocab = tekken_tokenizer(tekken), len(tekken.tokens)
    print(f"Tekken vocabulary: {n_vocab} tokens; {rows} rows, {steps} steps")
    print(f"{'grammar':>12} {'one mask':>9} {'rows one by one':>16} {'rows together':>14} "
          f"{'speedup':>18}")  # fmt: skip
    out = {}
    grammars = {
        "json_schema": LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), {"whitespace_flexible": False}
        ),
        "regex": LLMatcher.grammar_from_regex(REGEX),
        "bounded": LLMatcher.grammar_from_regex(BOUNDED),
    }
    for name, grammar in grammars.items():
        r = _walk(tokenizer, grammar, rows, steps, n_vocab)
        out[name] = r
        print(
            f"{name:>12} {r['one_mask_us']:>7.0f}us {r['rows_one_by_one_ms']:>14.2f}ms "
            f"{r['rows_together_ms']:>12.2f}ms {r['speedup_median']:>6.2f}x "
            f"({r['speedup_min']:.2f}-{r['speedup_max']:.2f})"
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tekken", default="auto")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    run(a.tekken, a.rows, a.steps)


if __name__ == "__main__":
    main()
