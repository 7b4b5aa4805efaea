"""Speculative rows in one batch (engine_service/speculative/batch.py), in process: per-row
rollback of every batch cache kind, and batched speculation equal to plain decoding on the
plain, sliding-window and hybrid (recurrent) tiny models, with rollbacks counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache

from engine_service.kv.batch_cache import BatchQuantizedKVCache, adopt_row
from engine_service.kv.ring_cache import BatchQuantizedRingCache
from engine_service.loop.compiled_decode import CompiledDecode
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.kv_codec import PLAIN_KV, KVCodec
from engine_service.protocol.sampling_options import SamplingOptions
from engine_service.sampling.samplers import SeededSampler
from engine_service.speculative.batch import SpecRow, SpeculativeBatch, prefilled

TOKENS = 40
EIGHT_BIT = KVCodec(8, 64)


@pytest.fixture(scope="module")
def draft(engine_data_dir: Path) -> LoadedModel:
    return load_model("tandem-tiny-draft", engine_data_dir)


def _prompt(j: int) -> list[int]:
    return [(i * 977 + j * 31) % 2000 + 3 for i in range(17 + 13 * j)]


def _planes(row: Any) -> list[mx.array]:
    keys = row.keys if isinstance(row.keys, tuple) else (row.keys,)
    values = row.values if isinstance(row.values, tuple) else (row.values,)
    return [p[..., : row.offset, :] for p in (*keys, *values)]


def test_kv_rollback_per_row_equals_never_having_the_tokens() -> None:
    """Rows of one batch (plain, 8-bit, TurboQuant 3/3) take a 5-token block and give back
    0..4 of it each: every row then holds, byte for byte, what a batch of that row alone holds
    after only the block's kept tokens, on one column axis with the others."""
    codecs = [PLAIN_KV, EIGHT_BIT, KVCodec.turboquant(3, 3), PLAIN_KV, EIGHT_BIT]
    mx.random.seed(0)
    rows = []
    for n, codec in zip([5, 9, 3, 12, 1], codecs, strict=True):
        solo = KVCache()
        solo.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        rows.append(adopt_row(solo, codec))
    block_k = mx.random.normal((5, 2, 5, 64))
    block_v = mx.random.normal((5, 2, 5, 64))
    batch = BatchQuantizedKVCache.merge(rows)
    batch.update_and_fetch(block_k, block_v)  # the quantized rows convert before the block
    back = [0, 3, 4, 1, 4]
    batch.rollback(back)
    for i, (row, kept) in enumerate(zip(rows, back, strict=True)):
        keep = 5 - kept
        alone = BatchQuantizedKVCache.merge([row])
        alone.update_and_fetch(block_k[i : i + 1, :, :keep], block_v[i : i + 1, :, :keep])
        want, got = alone.extract(0), batch.extract(i)
        assert got.offset == want.offset == batch.offset[i].item()
        assert type(got) is type(want)
        for a, b in zip(_planes(got), _planes(want), strict=True):
            assert mx.array_equal(a, b), (i, codecs[i])


def test_ring_rollback_after_a_block_keeps_each_window() -> None:
    """Wrapped and unwrapped rings take a 5-token block (the concat path) and give back
    different counts: each row then attends exactly its window of its own tokens."""
    window = 16
    mx.random.seed(1)
    tokens = [mx.random.normal((1, 2, n, 32)) for n in (30, 7, 16)]
    rings = []
    for t in tokens:
        ring = RotatingKVCache(max_size=window)
        for s in range(t.shape[2]):  # one at a time: the rings wrap in place
            ring.update_and_fetch(t[..., s : s + 1, :], t[..., s : s + 1, :])
        rings.append(adopt_row(ring, PLAIN_KV))
    batch = BatchQuantizedRingCache.merge(rings)
    block = mx.random.normal((3, 2, 5, 32))
    batch.update_and_fetch(block, block)
    back = [2, 4, 0]
    batch.rollback(back)
    step = mx.random.normal((3, 2, 1, 32))
    mask = batch.make_mask(1)  # before the update, as the model asks for it
    keys, _ = batch.update_and_fetch(step, step)  # a decode step after the rollback
    for i, t in enumerate(tokens):
        kept = mx.concatenate([t, block[i : i + 1, :, : 5 - back[i]], step[i : i + 1]], axis=2)
        seen: Any = mask[i, 0, 0].tolist()
        visible = keys[i, 0, mx.array([c for c, v in enumerate(seen) if v])]
        assert _as_rows(visible) == _as_rows(kept[0, 0, -window:]), i
        assert batch.offset[i].item() == t.shape[2] + 5 - back[i] + 1


def _as_rows(vectors: mx.array) -> list[tuple[float, ...]]:
    """Key vectors as a sorted list (a ring holds its window in rotated order)."""
    listed: Any = vectors.tolist()
    return sorted(tuple(v) for v in listed)


def _plain_tokens(model: Any, prompt: list[int], options: SamplingOptions) -> list[int]:
    sampler = None if options.greedy else SeededSampler(options)
    steps = generate_step(mx.array(prompt), model, max_tokens=TOKENS, sampler=sampler)
    return [int(t) for (t, _), _ in zip(steps, range(TOKENS), strict=False)]


def _run_batch(batch: SpeculativeBatch, wanted: dict[str, int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {rid: [] for rid in wanted}
    while batch.rows:
        results = batch.round([wanted[r.request_id] - len(out[r.request_id]) for r in batch.rows])
        done = []
        for row, result in zip(batch.rows, results, strict=True):
            out[row.request_id] += result.tokens
            if len(out[row.request_id]) >= wanted[row.request_id]:
                done.append(row.request_id)
        for rid in done:
            batch.remove(rid)
    return out


@pytest.mark.parametrize(
    ("name", "wide", "compiled"),
    [
        ("", False, False),
        ("tandem-tiny-swa", False, False),
        ("tandem-tiny-hybrid", False, False),
        ("", True, True),  # as on MLX-CUDA: whole planes read, the draft's steps compiled
    ],
)
def test_batched_speculation_equals_plain_decoding(
    name: str, wide: bool, compiled: bool, engine_data_dir: Path, draft: LoadedModel
) -> None:
    """Eight rows (greedy and seeded, draft lengths 1..6, prompts of 17 to 108 tokens, so
    64-token rings wrap) decode together; each equals mlx-lm's plain decoding of it alone.
    Rows join while others run, and rejected proposals are rolled back many times."""
    target = load_model(name, engine_data_dir)
    stepper = CompiledDecode(draft.model, 8) if compiled else draft.model
    batch = SpeculativeBatch(target.model, stepper, wide_reads=wide)
    options = [SamplingOptions(), SamplingOptions(temperature=0.8, seed=3)]
    lengths = [1, 2, 3, 4, 6, 2, 5, 3]
    wanted = {str(j): TOKENS for j in range(8)}

    def add(j: int) -> None:
        prompt = _prompt(j)
        row = SpecRow(str(j), list(prompt), 0, lengths[j], options[j % 2])
        draft_cache = prefilled(draft.model, prompt[:-2])
        batch.add(row, prefilled(target.model, prompt[:-1]), draft_cache)

    for j in range(6):
        add(j)
    early = batch.round([TOKENS] * 6)  # two rows join a batch that has run a round
    for j in (6, 7):
        add(j)
    got = _run_batch(batch, {**wanted, **{str(j): TOKENS - len(early[j].tokens) for j in range(6)}})
    for j in range(8):
        head = early[j].tokens if j < 6 else []
        assert head + got[str(j)] == _plain_tokens(target.model, _prompt(j), options[j % 2]), j
    counters = batch.counters
    assert counters.rollbacks_total > 20
    if compiled:
        assert stepper.compiled_steps > 0
    assert 0 < counters.accepted_total < counters.drafted_total


def test_a_row_that_cannot_join_leaves_the_batch_as_it_was(
    engine_data_dir: Path, draft: LoadedModel
) -> None:
    """A row whose draft caches do not fit (one layer short) is refused whole: the target's
    caches lose it again, and the rows already there decode on exactly."""
    target = load_model("", engine_data_dir)
    batch = SpeculativeBatch(target.model, draft.model)
    prompt = _prompt(2)
    row = SpecRow("a", list(prompt), 0, 3, SamplingOptions())
    batch.add(row, prefilled(target.model, prompt[:-1]), prefilled(draft.model, prompt[:-2]))
    other = _prompt(3)
    bad = SpecRow("b", list(other), 0, 3, SamplingOptions())
    with pytest.raises(ValueError):
        batch.add(bad, prefilled(target.model, other[:-1]), prefilled(draft.model, other[:-2])[1:])
    assert [r.request_id for r in batch.rows] == ["a"]
    assert all(int(c.offset.shape[0]) == 1 for c in batch.target_cache)
    got = _run_batch(batch, {"a": TOKENS})
    assert got["a"] == _plain_tokens(target.model, prompt, SamplingOptions())
