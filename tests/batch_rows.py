"""In-process batches over the engine's KV rows (adopt_row) in the engine's generator (its
first tokens from the prompts' last chunks: model/folded_prefill.py), for tests comparing a
row in a batch with the same request alone, or with the engine."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from engine_service.kv.batch_cache import adopt_row
from engine_service.model.folded_prefill import FoldingBatchGenerator
from engine_service.model.last_positions import LastPositions
from engine_service.protocol.kv_codec import KVCodec
from tandem_client.errors import TandemError


def engine_generator(model: Any, batch: int) -> BatchGenerator:
    """The engine's generator (loop/scheduler.py makes it so), rows of `batch` at once."""
    positions = LastPositions.probe(model)
    return FoldingBatchGenerator(
        model, positions, completion_batch_size=batch, prefill_batch_size=batch
    )


def insert(
    bg: BatchGenerator, prompts: list[list[int]], n: int, caches: list[Any], codecs: list[KVCodec]
) -> list[int]:
    """bg.insert, with quantized rows' last prompt token kept a step of its own, as the engine
    keeps it (loop/new_rows.py)."""
    uids: list[int] = bg.insert(prompts, max_tokens=[n] * len(prompts), caches=caches)
    if isinstance(bg, FoldingBatchGenerator):
        bg.keep_apart([u for u, c in zip(uids, codecs, strict=True) if c.quantized])
    return uids


def batched(
    model: Any, prompts: list[list[int]], n: int, codecs: list[KVCodec]
) -> tuple[list[list[int]], list[list[Any]]]:
    """The requests as one continuous batch over BatchQuantizedKVCache rows: tokens and
    logprobs of each, in order."""
    bg = engine_generator(model, 16)
    caches = [[adopt_row(c, codec) for c in make_prompt_cache(model)] for codec in codecs]
    uids = insert(bg, prompts, n, caches, codecs)
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    logprobs: dict[int, list[Any]] = {u: [] for u in uids}
    while any(len(v) < n for v in tokens.values()):
        for r in bg.next()[1]:
            tokens[r.uid].append(r.token)
            logprobs[r.uid].append(r.logprobs)
    return [tokens[u] for u in uids], [logprobs[u] for u in uids]


def alone(model: Any, prompt: list[int], n: int, codec: KVCodec) -> tuple[list[int], list[Any]]:
    """The request in a batch of its own: the solo reference (mlx-lm has no TurboQuant cache)."""
    tokens, logprobs = batched(model, [prompt], n, [codec])
    return tokens[0], logprobs[0]


def remove_after(
    model: Any, prompts: list[list[int]], codecs: list[KVCodec], index: int, tokens: int
) -> tuple[list[int], list[Any], list[int]]:
    """Runs the requests as one batch until request `index` has `tokens` tokens, then takes
    it out with its caches: (its tokens, its layer caches, the history they hold)."""
    bg = engine_generator(model, 8)
    rows = [[adopt_row(c, k) for c in make_prompt_cache(model)] for k in codecs]
    uids = insert(bg, prompts, 60, rows, codecs)
    got: list[int] = []
    while len(got) < tokens:
        got += [r.token for r in bg.next()[1] if r.uid == uids[index]]
    caches, history = bg.remove([uids[index]], return_prompt_caches=True)[uids[index]]
    return got, caches, history


def decoding_batch(model: Any, prompt: list[int], codec: KVCodec) -> BatchGenerator:
    """A batch already decoding one request (three steps in): for rows to join."""
    bg = engine_generator(model, 8)
    caches = [[adopt_row(c, codec) for c in make_prompt_cache(model)]]
    insert(bg, [prompt], 60, caches, [codec])
    for _ in range(3):
        bg.next()
    return bg


def tokens_of(bg: BatchGenerator, uid: int, n: int) -> list[int]:
    """The next n tokens row `uid` generates."""
    out: list[int] = []
    while len(out) < n:
        out += [r.token for r in bg.next()[1] if r.uid == uid]
    return out


def max_logprob_difference(a: list[Any], b: list[Any]) -> float:
    """The largest difference of two runs' logprobs, relative to their size: a trained
    model's unlikely tokens sit at -20 to -40, where fp32 sums in another order differ in
    the fourth digit."""
    return max(
        float((mx.abs(x - y) / mx.maximum(mx.abs(y), 1.0)).max()) for x, y in zip(a, b, strict=True)
    )


def joining_a_decoding_batch(
    engine: Any, anchor_id: str, cases: int, run_case: Callable[[int], Iterator[list[int]]]
) -> list[list[int]]:
    """Runs `cases` streams on an engine, each joining a batch already decoding, and checks it
    did: a plain anchor row has made tokens before the first case is sent and is still
    running (then cancelled) after the last one ended. Staggered: each case is sent once the
    one before it has a token of its own. run_case(i) yields case i's token ids chunk by
    chunk; the result is each case's tokens."""
    anchor: list[Any] = []
    anchor_decoding = threading.Event()
    started = [threading.Event() for _ in range(cases)]

    def run_anchor() -> None:
        for chunk in engine.stream(
            "anchor", request_id=anchor_id, max_tokens=4000, ignore_eos=True
        ):
            anchor.append(chunk)
            if chunk.token_ids:
                anchor_decoding.set()

    def run(i: int) -> list[int]:
        if i:
            assert started[i - 1].wait(60), f"case {i - 1} made no token"
        got: list[int] = []
        for token_ids in run_case(i):
            got.extend(token_ids)
            if got:
                started[i].set()
        return got

    anchor_thread = threading.Thread(target=run_anchor)
    anchor_thread.start()
    try:
        assert anchor_decoding.wait(60), "the anchor row made no token"
        with ThreadPoolExecutor(cases) as pool:
            results = list(pool.map(run, range(cases)))
    finally:
        with contextlib.suppress(TandemError):  # ended already: said below
            engine.cancel(anchor_id)
        anchor_thread.join(60)
    assert anchor and anchor[-1].finish_reason == "cancelled", "the anchor ended early"
    return results
