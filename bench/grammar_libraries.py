"""llguidance (the matcher Tandem uses) beside xgrammar (the one vLLM and SGLang use), on the
same real vocabulary (mistral-common's Tekken, 131,072 tokens; bench/vocab_masks.py) and the
same grammars: compile time, mask time a step, and the cost of rebuilding a matcher past
1,000 generated tokens (what a resume needs: neither library serializes a matcher's state).

Both matchers walk the same random path (each step's token drawn from the tokens both masks
allow), and each step is timed both ways, the order alternating.

xgrammar needs torch (and, on Linux x86, triton): several GB that Tandem does not install.
Run this from a virtualenv of its own:

    python3 -m venv /tmp/xg && /tmp/xg/bin/pip install xgrammar llguidance numpy
    /tmp/xg/bin/python bench/grammar_libraries.py [--tekken auto|PATH] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from bench.vocab_masks import BOUNDED, REGEX, SCHEMA, read_tekken, tekken_file, tekken_tokenizer  # noqa: E402


def _median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


def compare(name: str, ll_grammar: str, xg_compile: Any, ll_tok: Any, n_vocab: int,
            steps: int) -> None:  # fmt: skip
    import xgrammar as xgr
    from llguidance import LLMatcher

    t = time.perf_counter()
    compiled = xg_compile()
    xg_compile_s = time.perf_counter() - t
    t = time.perf_counter()
    ll = LLMatcher(ll_tok, ll_grammar, log_level=0)
    ll_compile_s = time.perf_counter() - t
    xg = xgr.GrammarMatcher(compiled)
    words = (n_vocab + 31) // 32
    ll_mask = np.zeros((words,), dtype=np.int32)
    xg_mask = xgr.allocate_token_bitmask(1, n_vocab)
    ll_s: list[float] = []
    xg_s: list[float] = []
    rng = np.random.default_rng(0)
    path: list[int] = []
    for step in range(steps):

        def by_ll() -> None:
            t = time.perf_counter()
            ll.unsafe_compute_mask_ptr(ll_mask.ctypes.data, words * 4)
            ll_s.append(time.perf_counter() - t)

        def by_xg() -> None:
            t = time.perf_counter()
            xg.fill_next_token_bitmask(xg_mask, 0)
            xg_s.append(time.perf_counter() - t)

        for way in (by_ll, by_xg) if step % 2 == 0 else (by_xg, by_ll):
            way()
        # A token both allow: llguidance keeps to canonical tokenizations (`{"` and not `{`
        # then `"`), xgrammar allows both, so their masks differ at the edges.
        ll_bits = np.unpackbits(ll_mask.view(np.uint8), bitorder="little")[:n_vocab]
        xg_bits = np.unpackbits(xg_mask[0].numpy().view(np.uint8), bitorder="little")
        both = np.flatnonzero(ll_bits & xg_bits[:n_vocab])
        choices = both[both != 2]
        if not len(choices):
            break
        token = int(rng.choice(choices))
        if not ll.consume_token(token) or not xg.accept_token(token):
            break
        path.append(token)
    # A resume: a fresh matcher past the path.
    t = time.perf_counter()
    again = LLMatcher(ll_tok, ll_grammar, log_level=0)
    again.consume_tokens(path)
    ll_replay = time.perf_counter() - t
    t = time.perf_counter()
    xg_again = xgr.GrammarMatcher(compiled)
    for token in path:
        xg_again.accept_token(token)
    xg_replay = time.perf_counter() - t
    print(
        f"{name:>12}  steps {len(path):>4}  mask llguidance {_median_us(ll_s):>6.0f} us, "
        f"xgrammar {_median_us(xg_s):>6.0f} us (xgrammar/llguidance "
        f"{statistics.median(x / y for x, y in zip(xg_s, ll_s, strict=False)):.2f}); "
        f"compile {ll_compile_s * 1e3:.1f} / {xg_compile_s * 1e3:.1f} ms; "
        f"replay of {len(path)} tokens {ll_replay * 1e3:.2f} / {xg_replay * 1e3:.2f} ms"
    )


def main() -> None:
    import xgrammar as xgr
    from llguidance import LLMatcher

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tekken", default="auto")
    p.add_argument("--steps", type=int, default=300)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-tekken-") as tmp:
        path = tekken_file(a.tekken, Path(tmp))
        tekken = read_tekken(path)
    ll_tok, vocab, n_vocab = tekken_tokenizer(tekken), tekken.tokens, len(tekken.tokens)
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=n_vocab,
                             stop_token_ids=[2])  # fmt: skip
    compiler = xgr.GrammarCompiler(info)
    versions = {name: metadata.version(name) for name in ("llguidance", "xgrammar", "torch")}
    print(f"Tekken vocabulary {n_vocab}; {versions}")
    schema = json.dumps(SCHEMA)
    cases = {
        "json_schema": (
            LLMatcher.grammar_from_json_schema(schema, {"whitespace_flexible": False}),
            lambda: compiler.compile_json_schema(
                schema, any_whitespace=False, separators=(",", ":")
            ),
        ),
        "regex": (LLMatcher.grammar_from_regex(REGEX), lambda: compiler.compile_regex(REGEX)),
        "bounded": (LLMatcher.grammar_from_regex(BOUNDED), lambda: compiler.compile_regex(BOUNDED)),
    }
    for name, (ll_grammar, xg_compile) in cases.items():
        compare(name, ll_grammar, xg_compile, ll_tok, n_vocab, a.steps)


if __name__ == "__main__":
    main()
