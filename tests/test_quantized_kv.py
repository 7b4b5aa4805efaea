"""Batched quantized KV caches: parity with mlx-lm's solo QuantizedKVCache, mixed batches,
row moves that keep the packed bytes, and checkpoints of quantized rows through a store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache

from engine_service.kv import batch_writes  # where the flag is read
from engine_service.kv.batch_cache import BatchQuantizedKVCache, PackedRow, adopt_row
from engine_service.protocol.kv_codec import KVCodec
from tandem_client import EngineClient, StoreClient
from tandem_client.errors import TandemError
from tests.batch_rows import batched, joining_a_decoding_batch, max_logprob_difference
from tests.servers import (
    ServiceProcess,
    free_port,
    kill_after_checkpoint,
    resume_equals_uninterrupted,
    start_engine,
    start_store_on,
)

TEXT = "The quick brown fox jumps over the lazy dog. "


def solo(model: Any, prompt: list[int], n: int, codec: KVCodec) -> tuple[list[int], list[Any]]:
    """mlx-lm's own solo generation (QuantizedKVCache via --kv-bits): tokens and logprobs."""
    kw: dict[str, Any] = {}
    if codec.bits:
        kw = dict(kv_bits=codec.bits, kv_group_size=codec.group_size)
        kw["quantized_kv_start"] = codec.start
    out = list(generate_step(mx.array(prompt), model, max_tokens=n, **kw))
    return [int(t) for t, _ in out], [lp for _, lp in out]


@pytest.mark.parametrize("full_width", [False, True], ids=["slices", "full-width"])
@pytest.mark.parametrize("bits", [8, 4])
def test_all_quantized_batch_matches_mlx_lm_solo(
    reference: Any, bits: int, full_width: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row packed: attention runs mlx-lm's quantized SDPA over the batch's planes."""
    monkeypatch.setattr(batch_writes, "FULL_WIDTH_PLANES", full_width)
    tok = reference.tokenizer
    prompts = [tok.encode(TEXT * k) for k in (1, 4, 2, 7)]
    codecs = [KVCodec(bits, 64, 0)] * len(prompts)
    tokens, logprobs = batched(reference.model, prompts, 24, codecs)
    worst = 0.0
    for prompt, codec, got, got_lp in zip(prompts, codecs, tokens, logprobs, strict=True):
        want, want_lp = solo(reference.model, prompt, 24, codec)
        assert got == want
        worst = max(worst, max_logprob_difference(got_lp, want_lp))
    # Batched and solo quantized attention differ only in padding columns and reduction
    # order; on fp32 that stays far below any logit gap that could flip a greedy token.
    print(f"\n{bits}-bit batched vs solo QuantizedKVCache: max logprob difference {worst:.2e}")
    assert worst < 1e-3


@pytest.mark.parametrize("full_width", [False, True], ids=["slices", "full-width"])
def test_mixed_codecs_convert_at_their_own_steps(
    reference: Any, full_width: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16, 8-bit and 4-bit rows in one batch, converting at different token counts; the
    mixed steps attend over dequantized packed rows. full-width: what MLX-CUDA runs (whole
    step-grown planes, the mask hiding unused columns), forced here on the CPU."""
    monkeypatch.setattr(batch_writes, "FULL_WIDTH_PLANES", full_width)
    tok = reference.tokenizer
    prompts = [tok.encode(TEXT * k) for k in (3, 1, 5, 2)]
    codecs = [KVCodec(), KVCodec(8, 64, 0), KVCodec(4, 64, 30), KVCodec(8, 32, 75)]
    tokens, logprobs = batched(reference.model, prompts, 40, codecs)
    worst = 0.0
    for prompt, codec, got, got_lp in zip(prompts, codecs, tokens, logprobs, strict=True):
        want, want_lp = solo(reference.model, prompt, 40, codec)
        assert got == want, f"{codec} changed in a mixed batch"
        worst = max(worst, max_logprob_difference(got_lp, want_lp))
    print(f"\nmixed batch vs solo: max logprob difference {worst:.2e}")
    assert worst < 1e-3


def _planes(row: PackedRow) -> list[np.ndarray]:
    return [np.array(p) for p in (*row.keys, *row.values)]


def test_a_row_moved_to_another_batch_keeps_its_bytes_and_its_tokens(reference: Any) -> None:
    model, tok = reference.model, reference.tokenizer
    prompt = tok.encode(TEXT * 3)
    codec = KVCodec(4, 64, 0)
    want, _ = solo(model, prompt, 30, codec)

    first = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    others = [tok.encode(TEXT * k) for k in (1, 2)]
    rows = [[adopt_row(c, k) for c in make_prompt_cache(model)] for k in (KVCodec(), codec)]
    rows.append([adopt_row(c, KVCodec(8, 64, 0)) for c in make_prompt_cache(model)])
    uids = first.insert([others[0], prompt, others[1]], max_tokens=[60] * 3, caches=rows)
    got: list[int] = []
    while len(got) < 12:
        got += [r.token for r in first.next()[1] if r.uid == uids[1]]
    moved = first.remove([uids[1]], return_prompt_caches=True)[uids[1]]
    caches, history = moved
    assert all(isinstance(c, PackedRow) for c in caches)
    held = len(history)  # prompt + generated tokens the cache holds
    assert held == len(prompt) + len(got)

    second = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    second.insert(
        [tok.encode(TEXT * 6)],
        max_tokens=[60],
        caches=[[adopt_row(c, KVCodec(8, 64, 0)) for c in make_prompt_cache(model)]],
    )
    for _ in range(3):
        second.next()
    before = [_planes(c) for c in caches]
    (uid,) = second.insert(
        [[want[len(got)]]], max_tokens=[30 - len(got) - 1], caches=[caches], all_tokens=[history]
    )
    second.next()  # joins the running batch: merge, then extend
    layer0 = second._generation_batch.prompt_cache[0]
    assert isinstance(layer0, BatchQuantizedKVCache)
    assert layer0.row_storage(1) == codec.storage
    rejoined = second.extract_cache([uid])[uid][0]
    for b, c in zip(before, rejoined, strict=True):
        after = _planes(c)
        for x, y in zip(b, after, strict=True):  # the moved positions, byte for byte
            assert np.array_equal(x, y[..., : x.shape[2], :])
    rest: list[int] = []
    while len(rest) < 30 - len(got) - 1:
        rest += [r.token for r in second.next()[1] if r.uid == uid]
    assert got + [want[len(got)]] + rest == want


def test_batch_state_round_trips_through_from_state(reference: Any) -> None:
    tok = reference.tokenizer
    prompts = [tok.encode(TEXT * k) for k in (1, 3)]
    bg = BatchGenerator(reference.model, completion_batch_size=4, prefill_batch_size=4)
    rows = [
        [adopt_row(c, k) for c in make_prompt_cache(reference.model)]
        for k in (KVCodec(), KVCodec(8, 64, 0))
    ]
    bg.insert(prompts, max_tokens=[20, 20], caches=rows)
    for _ in range(6):
        bg.next()
    layer = bg._generation_batch.prompt_cache[0]
    copy = BatchQuantizedKVCache.from_state(layer.state, layer.meta_state)
    heads, kdim, vdim, _ = layer._shape
    keys, values = mx.ones((2, heads, 1, kdim)), mx.ones((2, heads, 1, vdim))
    a = layer.update_and_fetch(keys, values)
    b = copy.update_and_fetch(keys, values)
    assert mx.array_equal(a[0], b[0]) and mx.array_equal(a[1], b[1])
    assert copy.meta_state == layer.meta_state


# -- through the engine process ------------------------------------------------------------


def test_quantized_requests_in_a_running_engine_match_solo(
    engine_client: EngineClient, reference: Any
) -> None:
    """Requests join and leave: a plain stream runs while 8- and 4-bit ones arrive late,
    convert at different steps and finish at different lengths."""
    tok = reference.tokenizer
    cases = [
        (TEXT * 4, KVCodec(), 48),
        (TEXT * 1, KVCodec(8, 64, 0), 20),
        (TEXT * 2, KVCodec(4, 64, 40), 36),
        (TEXT * 3, KVCodec(8, 32, 70), 28),
        (TEXT * 5, KVCodec(4, 32, 0), 12),
    ]
    # Each case joins a batch already decoding, checked (batch_rows.joining_a_decoding_batch).

    def run(i: int) -> Iterator[list[int]]:
        text, codec, n = cases[i]
        for chunk in engine_client.stream(
            tok.encode(text),
            max_tokens=n,
            ignore_eos=True,
            kv_bits=codec.bits,
            kv_group_size=codec.group_size,
            quantized_kv_start=codec.start,
        ):
            yield list(chunk.token_ids)

    results = joining_a_decoding_batch(engine_client, "quantized-anchor", len(cases), run)
    for (text, codec, n), got in zip(cases, results, strict=True):
        assert got == solo(reference.model, tok.encode(text), n, codec)[0], codec


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(kv_bits=3), "kv_bits"),
        (dict(kv_bits=8, kv_group_size=48), "kv_group_size"),
        (dict(kv_bits=4, kv_group_size=128), "does not divide"),
        (dict(kv_bits=8, quantized_kv_start=-1), "quantized_kv_start"),
    ],
)
def test_bad_kv_options_are_invalid_argument(
    engine_client: EngineClient, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(TandemError) as err:
        engine_client.generate("hello", max_tokens=2, **fields)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(err.value)


def test_engine_flags_set_the_default_codec(
    engine_data_dir: Path, tmp_path: Path, reference: Any
) -> None:
    proc = start_engine(
        engine_data_dir, "--kv-bits", "8", "--quantized-kv-start", "16", log_dir=tmp_path
    )
    try:
        with EngineClient(proc.address) as client:
            info = client.model_info()
            assert set(info.layout) == {"kv:quant:8:64:from16"}
            assert (info.kv_bits, info.kv_group_size, info.quantized_kv_start) == (8, 64, 16)
            ids = reference.tokenizer.encode(TEXT * 2)
            default = client.generate(ids, max_tokens=20, ignore_eos=True)
            plain = client.generate(ids, max_tokens=20, ignore_eos=True, kv_bits=0)
        assert default.token_ids == solo(reference.model, ids, 20, KVCodec(8, 64, 16))[0]
        assert plain.token_ids == solo(reference.model, ids, 20, KVCodec())[0]
    finally:
        proc.stop()


# -- checkpoints of quantized rows ---------------------------------------------------------

PROMPT = [(i * 977) % 2000 + 3 for i in range(300)]


@pytest.fixture
def stack(
    tmp_path: Path, engine_data_dir: Path
) -> Iterator[tuple[ServiceProcess, ServiceProcess, int]]:
    port = free_port()
    store = start_store_on(tmp_path / "store", port)
    engine = start_engine(engine_data_dir, "--store", f"127.0.0.1:{port}", log_dir=tmp_path)
    procs = [store, engine]
    try:
        yield store, engine, port
    finally:
        for p in procs:
            p.stop()


def test_quantized_checkpoints_resume_exactly_and_never_mix_with_plain(
    stack: tuple[ServiceProcess, ServiceProcess, int], engine_data_dir: Path, tmp_path: Path
) -> None:
    store_proc, engine_proc, port = stack
    q8 = dict(kv_bits=8, kv_group_size=64, quantized_kv_start=0)
    with EngineClient(engine_proc.address) as engine:
        # A prefix saved by an 8-bit request serves 8-bit requests only.
        first = engine.generate(PROMPT, max_tokens=8, ignore_eos=True, **q8)
        again = engine.generate(PROMPT, max_tokens=8, ignore_eos=True, **q8)
        plain = engine.generate(PROMPT, max_tokens=8, ignore_eos=True, kv_bits=0)
        assert again.usage is not None and plain.usage is not None
        assert again.usage.cached_prompt_tokens == len(PROMPT) - 1
        assert again.token_ids == first.token_ids
        assert plain.usage.cached_prompt_tokens == 0

    request = dict(max_tokens=64, ignore_eos=True, checkpoint_interval=8, request_id="q-1", **q8)
    store = StoreClient(f"127.0.0.1:{port}")
    received, saved = kill_after_checkpoint(engine_proc, store, PROMPT, request, 33, 24)
    assert saved.layout == ["kv:quant:8:64"] * len(saved.layout)
    assert any(t.dtype == "uint32" for t in saved.tensors)  # packed planes, as they were
    fresh = start_engine(engine_data_dir, "--store", f"127.0.0.1:{port}", log_dir=tmp_path)
    try:
        resume_equals_uninterrupted(fresh.address, PROMPT, request, received, {"kv_bits": 4})
    finally:
        fresh.stop()
        store.close()
    del store_proc
