"""Sliding-window (ring) KV rows in the batch, plain or quantized (issue 18): plain rings equal
mlx-lm's BatchRotatingKVCache; affine and TurboQuant rings, wrapped and mixed in one batch,
decode each row as alone; a moved packed ring keeps its bytes; through the engine, a
TurboQuant ring's prefix is reused and its checkpoint resumes after SIGKILL exactly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from engine_service.checkpoints.cache_records import capture, restore_captured
from engine_service.kv.batch_cache import adopt_row
from engine_service.kv.ring_cache import BatchQuantizedRingCache, PackedRingRow
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.kv_codec import KVCodec, StorageKind, request_layout
from tandem_client import EngineClient, StoreClient
from tests.batch_rows import (
    alone,
    batched,
    decoding_batch,
    max_logprob_difference,
    remove_after,
    tokens_of,
)
from tests.servers import (
    ServiceProcess,
    free_port,
    kill_after_checkpoint,
    resume_equals_uninterrupted,
    start_engine,
    start_store_on,
)

TEXT = "The quick brown fox jumps over the lazy dog. "
TQ33 = KVCodec.turboquant(3, 3)


@pytest.fixture(scope="module")
def swa(engine_data_dir: Path) -> LoadedModel:
    """tandem-tiny-swa in this process: layers alternate a 64-token ring and full attention."""
    loaded = load_model("tandem-tiny-swa", engine_data_dir)
    assert loaded.layout == ["kv:rotating:64:0", "kv:plain"] * 2
    return loaded


def _prompts(swa: LoadedModel) -> list[list[int]]:
    # 18 to 120 tokens: two prompts are longer than the window, so rings wrap in the prefill,
    # and every ring wraps while it decodes 40 tokens.
    return [swa.tokenizer.encode(TEXT * k) for k in (1, 4, 2, 7)]


def test_plain_ring_rows_equal_mlx_lms_batch_rotating_cache(swa: LoadedModel) -> None:
    prompts = _prompts(swa)
    ours, _ = batched(swa.model, prompts, 40, [KVCodec()] * len(prompts))
    bg = BatchGenerator(swa.model, completion_batch_size=16, prefill_batch_size=16)
    uids = bg.insert(prompts, max_tokens=[40] * len(prompts))  # mlx-lm's own caches
    theirs: dict[int, list[int]] = {u: [] for u in uids}
    while any(len(v) < 40 for v in theirs.values()):
        for r in bg.next()[1]:
            theirs[r.uid].append(r.token)
    assert ours == [theirs[u] for u in uids]


def _ring_storage(bg: BatchGenerator) -> list[set[StorageKind]]:
    rings = [c for c in bg._generation_batch.prompt_cache if isinstance(c, BatchQuantizedRingCache)]
    assert rings and all(c.rotated for c in rings)  # every ring has wrapped
    return [{g.storage.kind for g in c._groups} for c in rings]


@pytest.mark.parametrize(
    "codecs",
    [
        [KVCodec(8, 64, 0)] * 4,
        [KVCodec.turboquant(4, 4)] * 4,
        [KVCodec(), TQ33, KVCodec(4, 32, 0), KVCodec.turboquant(4, 2, 30)],
    ],
    ids=["affine-8", "turboquant-4-4", "mixed"],
)
def test_quantized_ring_rows_decode_each_row_as_alone(
    swa: LoadedModel, codecs: list[KVCodec]
) -> None:
    prompts = _prompts(swa)
    tokens, logprobs = batched(swa.model, prompts, 40, codecs)
    worst = 0.0
    for prompt, codec, got, got_lp in zip(prompts, codecs, tokens, logprobs, strict=True):
        want, want_lp = alone(swa.model, prompt, 40, codec)
        assert got == want, codec.signature()
        worst = max(worst, max_logprob_difference(got_lp, want_lp))
    print(f"\nring rows batched vs alone: max logprob difference {worst:.2e}")
    assert worst < 1e-3
    # The rings really hold packed rows (mid-run, once wrapped).
    bg = BatchGenerator(swa.model, completion_batch_size=16, prefill_batch_size=16)
    caches = [[adopt_row(c, codec) for c in make_prompt_cache(swa.model)] for codec in codecs]
    bg.insert(prompts, max_tokens=[100] * len(prompts), caches=caches)
    for _ in range(70):
        bg.next()
    want_kinds = {c.storage.kind for c in codecs}
    assert all(kinds == want_kinds for kinds in _ring_storage(bg))


def _planes(row: PackedRingRow) -> list[np.ndarray]:
    assert row.keys is not None and row.values is not None
    return [np.array(p) for p in (*row.keys, *row.values)]


def test_a_wrapped_packed_ring_row_moved_to_another_batch_keeps_its_tokens(
    swa: LoadedModel,
) -> None:
    model, tok = swa.model, swa.tokenizer
    prompt = tok.encode(TEXT * 7)  # 120 tokens: past the window
    want, _ = alone(model, prompt, 30, TQ33)
    others = [tok.encode(TEXT * k) for k in (1, 2)]
    codecs = [KVCodec(), TQ33, KVCodec(8, 64, 0)]
    got, caches, history = remove_after(model, [others[0], prompt, others[1]], codecs, 1, 12)
    ring = caches[0]
    assert isinstance(ring, PackedRingRow) and ring.size() == 64 and ring.offset > 64

    second = decoding_batch(model, tok.encode(TEXT * 6), KVCodec(8, 64, 0))
    (uid,) = second.insert(
        [[want[len(got)]]], max_tokens=[30 - len(got) - 1], caches=[caches], all_tokens=[history]
    )
    second.next()  # joins the running batch: merge, then extend
    layer0 = second._generation_batch.prompt_cache[0]
    assert isinstance(layer0, BatchQuantizedRingCache)
    assert layer0.row_storage(1) == TQ33.storage
    rest = tokens_of(second, uid, 30 - len(got) - 1)
    assert got + [want[len(got)]] + rest == want


def test_a_packed_ring_row_extracted_and_merged_is_byte_identical(swa: LoadedModel) -> None:
    model, tok = swa.model, swa.tokenizer
    bg = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    codecs = (TQ33, KVCodec(4, 64, 0))
    rows = [[adopt_row(c, k) for c in make_prompt_cache(model)] for k in codecs]
    bg.insert([tok.encode(TEXT * 7), tok.encode(TEXT * 3)], max_tokens=[60] * 2, caches=rows)
    for _ in range(20):
        bg.next()
    ring = bg._generation_batch.prompt_cache[0]
    assert isinstance(ring, BatchQuantizedRingCache)
    for i in range(2):
        row = ring.extract(i)
        assert isinstance(row, PackedRingRow)
        again = BatchQuantizedRingCache.merge([row]).extract(0)
        assert isinstance(again, PackedRingRow)
        pairs = zip(_planes(row), _planes(again), strict=True)
        assert all(np.array_equal(a, b) for a, b in pairs)
        assert (again.offset, again.size()) == (row.offset, row.size())


def _saved_prefix(model: Any, prompt: list[int]) -> list[Any]:
    """What a prefix save does to a ring that has not wrapped (checkpoints/prefix_reuse.py): the
    row cut
    after its first token (converted to its codec by then), trimmed back to the prompt less
    its last token."""
    bg = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    rows = [[adopt_row(c, TQ33) for c in make_prompt_cache(model)]]
    (uid,) = bg.insert([prompt], max_tokens=[16], caches=rows)
    bg.next()  # the prefill and the first token
    bg.next()  # the rows convert at this call
    caches, _ = bg.extract_cache([uid])[uid]
    assert isinstance(caches[0], PackedRingRow) and caches[0].is_trimmable()
    assert can_trim_prompt_cache(caches)
    trim_prompt_cache(caches, 2)
    return list(caches)


def _continued(model: Any, caches: list[Any], prompt: list[int]) -> list[int]:
    """16 tokens from the caches, fed the prompt's last token."""
    rows = [[adopt_row(c, TQ33) for c in caches]]
    bg = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    (uid,) = bg.insert([prompt[-1:]], max_tokens=[16], caches=rows, all_tokens=[prompt[:-1]])
    got: list[int] = []
    while len(got) < 16:
        got += [r.token for r in bg.next()[1] if r.uid == uid]
    return got


def test_an_unwrapped_packed_ring_saved_as_a_prefix_continues_as_before_its_save(
    swa: LoadedModel,
) -> None:
    """A packed ring that has not wrapped, captured and restored as a prefix save does,
    continues exactly as the same caches would have without the store in between. (A
    64-token block and a 64-token window leave tandem-tiny-swa no prompt to save through the
    engine, so the mechanism is tested here.) Not as a fresh run: there the prompt's last
    token attends over plain keys, here over the packed ones the prefix holds, so a
    quantized prefix hit's tokens may differ from a miss's within the codec's own noise
    (docs/kv_quantization.md, "Quality")."""
    model = swa.model
    prompt = [(i * 37) % 1500 + 5 for i in range(40)]
    want = _continued(model, _saved_prefix(model, prompt), prompt)
    caches = _saved_prefix(model, prompt)
    restored = restore_captured(capture(caches, len(prompt) - 1), request_layout(swa.layout, TQ33))
    assert _continued(model, restored, prompt) == want


# -- through the engine process ------------------------------------------------------------

PROMPT = [(i * 977) % 2000 + 3 for i in range(300)]


@pytest.fixture
def swa_stack(tmp_path: Path, engine_data_dir: Path) -> Iterator[tuple[ServiceProcess, int]]:
    port = free_port()
    store = start_store_on(tmp_path / "store", port)
    engine = _swa_engine(engine_data_dir, port, tmp_path)
    try:
        yield engine, port
    finally:
        engine.stop()
        store.stop()


def _swa_engine(engine_data_dir: Path, port: int, log_dir: Path) -> ServiceProcess:
    flags = ["--model", "tandem-tiny-swa", "--store", f"127.0.0.1:{port}"]
    return start_engine(engine_data_dir, *flags, log_dir=log_dir)


def test_a_turboquant_ring_through_the_engine_resumes_after_sigkill(
    swa_stack: tuple[ServiceProcess, int], engine_data_dir: Path, tmp_path: Path, swa: Any
) -> None:
    engine_proc, port = swa_stack
    tq: dict[str, Any] = dict(kv_bits=3, kv_scheme="turboquant")
    with EngineClient(engine_proc.address) as engine:
        info = engine.model_info()
        assert list(info.layout) == ["kv:rotating:64:0", "kv:plain"] * 2
        ids = swa.tokenizer.encode(TEXT * 7)
        got = engine.generate(ids, max_tokens=24, ignore_eos=True, **tq)
        assert got.token_ids == alone(swa.model, ids, 24, TQ33)[0]

    request = dict(max_tokens=64, ignore_eos=True, checkpoint_interval=8, request_id="ring-1", **tq)
    store = StoreClient(f"127.0.0.1:{port}")
    received, saved = kill_after_checkpoint(engine_proc, store, PROMPT, request, 33, 24)
    ring = "kv:rotating:64:0:turboquant:3:3"
    assert saved.layout == [ring, "kv:turboquant:3:3"] * 2  # the wrapped rings, packed
    fresh = _swa_engine(engine_data_dir, port, tmp_path)
    try:
        resume_equals_uninterrupted(fresh.address, PROMPT, request, received)
    finally:
        fresh.stop()
        store.close()
