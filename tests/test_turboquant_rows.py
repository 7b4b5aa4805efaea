"""TurboQuant KV rows in the batch (issue 18): each row decodes in a batch as it does alone,
beside plain and affine rows; a moved row keeps its codes; batch state round-trips; and through
the engine, requests choose the codec, bad choices are INVALID_ARGUMENT, and a checkpoint of
packed rows resumes after SIGKILL exactly as the uninterrupted generation."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from engine_service.kv import attention_routing
from engine_service.kv.batch_cache import BatchQuantizedKVCache, TurboQuantRow, adopt_row
from engine_service.protocol.kv_codec import (
    KVCodec,
    Scheme,
    StorageKind,
    checked_codec,
    codec_of_signature,
    layout_accepts,
    request_layout,
)
from gateway_service.openai_errors import ApiError
from gateway_service.openai_wire import completion_request
from tandem_client import EngineClient, StoreClient
from tandem_client.engine_client import generate_request
from tandem_client.errors import TandemError
from tandem_wire.pb import engine_pb2
from tests.batch_rows import (
    alone,
    batched,
    decoding_batch,
    joining_a_decoding_batch,
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


@pytest.fixture
def counted_attention(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many attention calls took the TurboQuant path (the real one, counted)."""
    calls = [0]
    real = attention_routing.turboquant_attention

    def counting(*args: Any, **kwargs: Any) -> mx.array:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_routing, "turboquant_attention", counting)
    return calls


@pytest.mark.parametrize(
    "codec",
    [KVCodec.turboquant(4, 4), TQ33, KVCodec.turboquant(4, 2), KVCodec.turboquant(2, 2, 40)],
    ids=lambda c: c.signature(),
)
def test_a_batch_of_turboquant_rows_decodes_each_row_as_alone(
    reference: Any, codec: KVCodec, counted_attention: list[int]
) -> None:
    tok = reference.tokenizer
    prompts = [tok.encode(TEXT * k) for k in (1, 4, 2, 7)]
    tokens, logprobs = batched(reference.model, prompts, 24, [codec] * len(prompts))
    assert counted_attention[0] > 0  # the batch attended in the rotated domain
    worst = 0.0
    for prompt, got, got_lp in zip(prompts, tokens, logprobs, strict=True):
        want, want_lp = alone(reference.model, prompt, 24, codec)
        assert got == want
        worst = max(worst, max_logprob_difference(got_lp, want_lp))
    # Rows differ from their solo runs only in padding columns (zero codes and norms decode to
    # zero vectors, masked) and in reduction order: far below a greedy token's logit gap.
    print(f"\n{codec.signature()} batched vs alone: max logprob difference {worst:.2e}")
    assert worst < 1e-3


def test_turboquant_plain_and_affine_rows_share_a_batch(reference: Any) -> None:
    """Mixed formats: packed rows are decoded for the step into one plain tensor."""
    tok = reference.tokenizer
    prompts = [tok.encode(TEXT * k) for k in (3, 1, 5, 2, 4)]
    codecs = [
        KVCodec(),
        KVCodec(8, 64, 0),
        TQ33,
        KVCodec.turboquant(4, 2, 30),
        KVCodec(4, 32, 75),
    ]
    tokens, logprobs = batched(reference.model, prompts, 40, codecs)
    worst = 0.0
    for prompt, codec, got, got_lp in zip(prompts, codecs, tokens, logprobs, strict=True):
        want, want_lp = alone(reference.model, prompt, 40, codec)
        assert got == want, f"{codec.signature()} changed in a mixed batch"
        worst = max(worst, max_logprob_difference(got_lp, want_lp))
    print(f"\nmixed batch vs alone: max logprob difference {worst:.2e}")
    assert worst < 1e-3


def test_turboquant_rows_stay_close_to_plain_attention(reference: Any) -> None:
    """The codec's error as the model sees it: logprobs of the first 16 tokens of a greedy
    plain run, scored by 4-bit and 2-bit rows fed the same tokens, against plain ones."""
    tok = reference.tokenizer
    prompt = tok.encode(TEXT * 3)
    want, _ = alone(reference.model, prompt, 16, KVCodec())
    feed = prompt + want[:-1]

    def scored(codec: KVCodec) -> mx.array:
        cache = [adopt_row(c, codec) for c in make_prompt_cache(reference.model)]
        batch = [BatchQuantizedKVCache.merge([c]) for c in cache]
        logits = reference.model(mx.array([feed[: len(prompt)]]), cache=batch)[:, -1:]
        out = [logits]
        for t in feed[len(prompt) :]:
            out.append(reference.model(mx.array([[t]]), cache=batch))
        lp = mx.concatenate(out, axis=1)
        return lp - mx.logsumexp(lp, axis=-1, keepdims=True)

    plain = scored(KVCodec())
    errors = {b: float(mx.abs(scored(KVCodec.turboquant(b, b)) - plain).mean()) for b in (4, 2)}
    print(f"\nmean |logprob - plain| by bits: {errors}")
    assert errors[4] < errors[2]  # more bits, closer to plain


def _planes(row: TurboQuantRow) -> list[np.ndarray]:
    assert row.keys is not None and row.values is not None
    return [np.array(p) for p in (*row.keys, *row.values)]


def test_a_turboquant_row_moved_to_another_batch_keeps_its_codes_and_tokens(
    reference: Any,
) -> None:
    model, tok = reference.model, reference.tokenizer
    prompt = tok.encode(TEXT * 3)
    want, _ = alone(model, prompt, 30, TQ33)

    others = [tok.encode(TEXT * k) for k in (1, 2)]
    codecs = [KVCodec(), TQ33, KVCodec(8, 64, 0)]
    got, caches, history = remove_after(model, [others[0], prompt, others[1]], codecs, 1, 12)
    assert all(isinstance(c, TurboQuantRow) for c in caches)
    assert len(history) == len(prompt) + len(got)

    second = decoding_batch(model, tok.encode(TEXT * 6), KVCodec.turboquant(4, 2))
    before = [_planes(c) for c in caches]
    (uid,) = second.insert(
        [[want[len(got)]]], max_tokens=[30 - len(got) - 1], caches=[caches], all_tokens=[history]
    )
    second.next()  # joins the running batch: merge, then extend
    layer0 = second._generation_batch.prompt_cache[0]
    assert isinstance(layer0, BatchQuantizedKVCache)
    assert layer0.row_storage(1) == TQ33.storage
    assert layer0.row_storage(0).kind is StorageKind.TURBOQUANT  # the other row: 4/2 bits
    rejoined = second.extract_cache([uid])[uid][0]
    for b, c in zip(before, rejoined, strict=True):
        for x, y in zip(b, _planes(c), strict=True):  # the moved positions, byte for byte
            assert np.array_equal(x, y[..., : x.shape[2], :])
    rest = tokens_of(second, uid, 30 - len(got) - 1)
    assert got + [want[len(got)]] + rest == want


def test_a_turboquant_batch_state_round_trips_through_from_state(reference: Any) -> None:
    tok = reference.tokenizer
    prompts = [tok.encode(TEXT * k) for k in (1, 3, 2)]
    bg = BatchGenerator(reference.model, completion_batch_size=4, prefill_batch_size=4)
    codecs = (KVCodec(), TQ33, KVCodec.turboquant(4, 2))
    rows = [[adopt_row(c, k) for c in make_prompt_cache(reference.model)] for k in codecs]
    bg.insert(prompts, max_tokens=[20] * 3, caches=rows)
    for _ in range(6):
        bg.next()
    layer = bg._generation_batch.prompt_cache[0]
    copy = BatchQuantizedKVCache.from_state(layer.state, layer.meta_state)
    heads, kdim, vdim, _ = layer._shape
    keys, values = mx.ones((3, heads, 1, kdim)), mx.ones((3, heads, 1, vdim))
    a = layer.update_and_fetch(keys, values)
    b = copy.update_and_fetch(keys, values)
    assert mx.array_equal(a[0], b[0]) and mx.array_equal(a[1], b[1])
    assert copy.meta_state == layer.meta_state


# -- the codec's rules and its request surfaces (in-process) -------------------------------


def test_turboquant_codec_rules_and_signatures() -> None:
    codec = checked_codec(3, 64, 0, Scheme.TURBOQUANT)
    assert codec == KVCodec.turboquant(3, 3) and codec.signature() == "kv:turboquant:3:3"
    late = checked_codec(4, 64, 512, Scheme.TURBOQUANT, 2)
    assert late.signature() == "kv:turboquant:4:2:from512"
    assert codec_of_signature(late.signature()) == late
    assert checked_codec(0, 64, 0, Scheme.TURBOQUANT) == KVCodec()  # 0 bits: plain
    for bad in [(5, 0), (3, 1), (8, 0)]:
        with pytest.raises(ValueError):
            checked_codec(bad[0], 64, 0, Scheme.TURBOQUANT, bad[1])
    with pytest.raises(ValueError, match="TurboQuant's"):
        checked_codec(4, 64, 0, Scheme.AFFINE, 2)
    # A request layout takes a converted layer of its own bits, or a plain one not yet
    # converted; never affine bytes nor another bit pair. Ring layers take the ring form
    # (no start: a ring converts after its first call); kept-token rings stay as they are.
    layout = ["kv:plain", "kv:rotating:64:0", "kv:rotating:64:4", "ssm:arrays:2"]
    want = request_layout(layout, late)
    ring = "kv:rotating:64:0:turboquant:4:2"
    assert want == ["kv:turboquant:4:2:from512", ring, "kv:rotating:64:4", "ssm:arrays:2"]
    for stored in (
        ["kv:turboquant:4:2", ring, "kv:rotating:64:4", "ssm:arrays:2"],
        ["kv:plain", "kv:rotating:64:0", "kv:rotating:64:4", "ssm:arrays:2"],
    ):
        assert layout_accepts(want, stored)
    for stored in (
        ["kv:turboquant:4:4", ring, "kv:rotating:64:4", "ssm:arrays:2"],
        ["kv:quant:4:64", ring, "kv:rotating:64:4", "ssm:arrays:2"],
        ["kv:plain", "kv:rotating:64:0:quant:4:64", "kv:rotating:64:4", "ssm:arrays:2"],
    ):
        assert not layout_accepts(want, stored)


def test_clients_and_gateway_carry_the_turboquant_choice() -> None:
    req = generate_request("hi", kv_bits=3, kv_scheme="turboquant", kv_value_bits=2)
    assert (req.kv_bits, req.kv_scheme, req.kv_value_bits) == (
        3,
        engine_pb2.KV_SCHEME_TURBOQUANT,
        2,
    )
    with pytest.raises(ValueError, match="kv_scheme"):
        generate_request("hi", kv_scheme="hadamard")
    body = {"prompt": "hi", "tandem": {"kv_scheme": "turboquant", "kv_bits": 3, "kv_value_bits": 3}}
    req = completion_request(body)
    assert (req.kv_bits, req.kv_scheme, req.kv_value_bits) == (
        3,
        engine_pb2.KV_SCHEME_TURBOQUANT,
        3,
    )
    with pytest.raises(ApiError) as err:
        completion_request({"prompt": "hi", "tandem": {"kv_scheme": "hadamard"}})
    assert err.value.status == 400


# -- through the engine process ------------------------------------------------------------


def test_turboquant_requests_in_a_running_engine_match_alone(
    engine_client: EngineClient, reference: Any
) -> None:
    """Requests join a running batch (checked: an anchor row decodes throughout) with their own
    codecs and finish at their own lengths."""
    tok = reference.tokenizer
    cases = [
        (TEXT * 4, KVCodec(), 40),
        (TEXT * 1, TQ33, 20),
        (TEXT * 2, KVCodec.turboquant(4, 2, 40), 36),
        (TEXT * 3, KVCodec(8, 64, 0), 28),
        (TEXT * 5, KVCodec.turboquant(2, 4), 12),
    ]

    # Each case joins a batch already decoding, checked (batch_rows.joining_a_decoding_batch).

    def run(i: int) -> Iterator[list[int]]:
        text, codec, n = cases[i]
        scheme = "turboquant" if codec.storage.kind is StorageKind.TURBOQUANT else "affine"
        for chunk in engine_client.stream(
            tok.encode(text),
            max_tokens=n,
            ignore_eos=True,
            kv_bits=codec.bits,
            kv_scheme=scheme,
            kv_value_bits=codec.value_bits,
            quantized_kv_start=codec.start,
        ):
            yield list(chunk.token_ids)

    results = joining_a_decoding_batch(engine_client, "turboquant-anchor", len(cases), run)
    for (text, codec, n), got in zip(cases, results, strict=True):
        assert got == alone(reference.model, tok.encode(text), n, codec)[0], codec.signature()


def _held_kv_bytes(engine: EngineClient, prompt: list[int], **codec: Any) -> int:
    """Stats.kv_cache_bytes while one stream of this codec decodes (past its conversion)."""
    stream = engine.stream_request(
        engine.request(prompt, max_tokens=2000, ignore_eos=True, **codec)
    )
    held = 0
    for i, _ in enumerate(stream):
        if i >= 40:  # well past the first reading (every 16 steps)
            held = engine.stats().kv_cache_bytes
            if held:
                break
    stream.close()  # cancels the call: the engine frees the row
    return held


def test_the_engine_reports_the_kv_bytes_its_batch_holds(
    engine_client: EngineClient, reference: Any
) -> None:
    """Stats (and /metrics) say what the running batch's caches hold: a 3/3 TurboQuant row
    holds ~8x fewer bytes than the same fp32 row (64-wide heads: 7 words and a norm against
    64 floats), then nothing once the batch is idle."""
    prompt = reference.tokenizer.encode(TEXT * 20)
    plain = _held_kv_bytes(engine_client, prompt, kv_bits=0)
    packed = _held_kv_bytes(engine_client, prompt, kv_bits=3, kv_scheme="turboquant")
    assert plain > 0 and packed > 0
    assert 6 < plain / packed < 10, (plain, packed)
    deadline = time.monotonic() + 10
    while engine_client.stats().kv_cache_bytes:
        assert time.monotonic() < deadline, "kv_cache_bytes stayed above 0 while idle"
        time.sleep(0.05)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(kv_bits=5, kv_scheme="turboquant"), "2, 3 or 4 for TurboQuant"),
        (dict(kv_bits=3, kv_scheme="turboquant", kv_value_bits=1), "kv_value_bits"),
        (dict(kv_bits=4, kv_value_bits=2), "TurboQuant's"),
    ],
)
def test_bad_turboquant_options_are_invalid_argument(
    engine_client: EngineClient, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(TandemError) as err:
        engine_client.generate("hello", max_tokens=2, **fields)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(err.value)


PROMPT = [(i * 977) % 2000 + 3 for i in range(300)]


def turboquant_engine(engine_data_dir: Path, port: int, log_dir: Path) -> ServiceProcess:
    """An engine on the store at `port` whose default codec is TurboQuant 3/3 (the flags)."""
    flags = ["--store", f"127.0.0.1:{port}", "--kv-scheme", "turboquant", "--kv-bits", "3"]
    return start_engine(engine_data_dir, *flags, log_dir=log_dir)


@pytest.fixture
def turboquant_stack(
    tmp_path: Path, engine_data_dir: Path
) -> Iterator[tuple[ServiceProcess, ServiceProcess, int]]:
    """A store and an engine whose default codec is TurboQuant 3/3 (the flags)."""
    port = free_port()
    store = start_store_on(tmp_path / "store", port)
    engine = turboquant_engine(engine_data_dir, port, tmp_path)
    try:
        yield store, engine, port
    finally:
        engine.stop()
        store.stop()


def test_turboquant_checkpoint_resumes_after_sigkill_as_uninterrupted(
    turboquant_stack: tuple[ServiceProcess, ServiceProcess, int],
    engine_data_dir: Path,
    tmp_path: Path,
    reference: Any,
) -> None:
    _, engine_proc, port = turboquant_stack
    with EngineClient(engine_proc.address) as engine:
        info = engine.model_info()
        assert set(info.layout) == {"kv:turboquant:3:3"}
        assert (info.kv_bits, info.kv_value_bits) == (3, 3)
        ids = reference.tokenizer.encode(TEXT * 2)
        default = engine.generate(ids, max_tokens=16, ignore_eos=True)
        assert default.token_ids == alone(reference.model, ids, 16, TQ33)[0]
        # A prefix saved by a TurboQuant request serves TurboQuant requests of its bits only.
        first = engine.generate(PROMPT, max_tokens=8, ignore_eos=True)
        again = engine.generate(PROMPT, max_tokens=8, ignore_eos=True)
        other = engine.generate(PROMPT, max_tokens=8, ignore_eos=True, kv_value_bits=2)
        assert again.usage is not None and other.usage is not None
        assert again.usage.cached_prompt_tokens == len(PROMPT) - 1
        assert again.token_ids == first.token_ids
        assert other.usage.cached_prompt_tokens == 0

    request = dict(max_tokens=64, ignore_eos=True, checkpoint_interval=8, request_id="tq-1")
    store = StoreClient(f"127.0.0.1:{port}")
    received, saved = kill_after_checkpoint(engine_proc, store, PROMPT, request, 33, 24)
    assert saved.layout == ["kv:turboquant:3:3"] * len(saved.layout)
    assert any(t.dtype == "uint32" for t in saved.tensors)  # the codes, as they were
    fresh = turboquant_engine(engine_data_dir, port, tmp_path)
    try:
        resume_equals_uninterrupted(fresh.address, PROMPT, request, received, {"kv_value_bits": 2})
    finally:
        fresh.stop()
        store.close()
