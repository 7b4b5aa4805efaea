"""Every cache type round-trips through a real store and gives the same next-token logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import cache as cache_lib
from mlx_lm.models.cache import trim_prompt_cache

from engine_service.checkpoints.cache_records import (
    CapturedCache,
    capture,
    check_restorable,
    plain_kv_only,
    restore,
    restore_with_room,
    to_host,
)
from engine_service.checkpoints.device_landing import planes_as_they_arrive
from engine_service.checkpoints.record_codec import compress
from engine_service.errors import Precondition
from engine_service.model.loading import layout_codec, load_model
from engine_service.protocol.kv_codec import Scheme
from engine_service.protocol.requests import RecordFormat
from tandem_client import Checkpoint, StoreClient

TEXT = "The quick brown fox jumps over the lazy dog. " * 12


def _through_store(client: StoreClient, caches: list[Any], tokens: int, key: bytes) -> list[Any]:
    captured = capture(caches, tokens)
    _put(client, captured, key)
    got = client.get(key)
    check_restorable(got.metadata, got.tensors, captured.layout)
    return restore(got.metadata, got.tensors, captured.layout)


def _put(client: StoreClient, captured: CapturedCache, key: bytes) -> None:
    client.put(
        Checkpoint(
            key=key,
            model_id="m",
            layout=captured.layout,
            metadata=captured.meta(),
            tensors=to_host(captured),
        )
    )


def _next_logits(model, token: mx.array, caches: list[Any]) -> mx.array:  # noqa: ANN001
    logits: mx.array = model(token, cache=caches)
    return logits


@pytest.mark.parametrize("variant", ["tandem-tiny", "tandem-tiny-swa", "tandem-tiny-hybrid"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_caches_round_trip(
    variant: str, dtype: str, engine_data_dir: Path, client: StoreClient, engine
) -> None:  # noqa: ANN001
    loaded = load_model(variant, engine_data_dir, dtype)
    ids = mx.array([loaded.tokenizer.encode(TEXT)])  # longer than the sliding window
    caches = loaded.model.make_cache()
    loaded.model(ids[:, :-1], cache=caches)
    restored = _through_store(client, caches, ids.shape[1] - 1, variant.encode() + dtype.encode())
    assert [type(c) for c in restored] == [type(c) for c in caches]
    assert [layout_codec(c) for c in restored] == loaded.layout
    expected = _next_logits(loaded.model, ids[:, -1:], caches)
    assert mx.array_equal(_next_logits(loaded.model, ids[:, -1:], restored), expected).item()


def test_quantized_and_chunked_kv_caches_round_trip(
    engine_data_dir: Path, client: StoreClient, engine
) -> None:  # noqa: ANN001
    loaded = load_model("tandem-tiny", engine_data_dir)
    ids = mx.array([loaded.tokenizer.encode(TEXT)])
    for kind, make in {
        "quant8": lambda: cache_lib.QuantizedKVCache(group_size=64, bits=8),
        "quant4": lambda: cache_lib.QuantizedKVCache(group_size=32, bits=4),
        "chunked": lambda: cache_lib.ChunkedKVCache(chunk_size=64),
    }.items():
        caches = [make() for _ in loaded.layout]
        loaded.model(ids[:, :-1], cache=caches)
        restored = _through_store(client, caches, ids.shape[1] - 1, kind.encode())
        assert type(restored[0]) is type(caches[0])
        expected = _next_logits(loaded.model, ids[:, -1:], caches)
        got = _next_logits(loaded.model, ids[:, -1:], restored)
        assert mx.array_equal(got, expected).item(), kind


def test_cache_list_round_trips(client: StoreClient) -> None:
    inner = [cache_lib.KVCache(), cache_lib.KVCache()]
    for c in inner:
        c.update_and_fetch(mx.random.normal((1, 2, 5, 8)), mx.random.normal((1, 2, 5, 8)))
    original = [cache_lib.CacheList(*inner)]
    (restored,) = _through_store(client, original, 5, b"cachelist")
    assert isinstance(restored, cache_lib.CacheList)
    for a, b in zip(original[0].caches, restored.caches, strict=True):
        assert mx.array_equal(a.state[0][..., :5, :], b.state[0][..., :5, :]).item()
        assert a.offset == b.offset


def test_a_row_extracted_from_the_batch_round_trips(
    engine_data_dir: Path, client: StoreClient, engine
) -> None:  # noqa: ANN001
    loaded = load_model("tandem-tiny", engine_data_dir)
    prompts = [loaded.tokenizer.encode(t) for t in (TEXT, "Hello", "Numbers: 1 2 3 4")]
    bg = BatchGenerator(loaded.model)
    uids = bg.insert(prompts, max_tokens=[32] * 3)
    for _ in range(6):
        bg.next()
    row, tokens = bg.extract_cache([uids[0]])[uids[0]]
    restored = _through_store(client, row, len(tokens), b"row")
    probe = mx.array([[5]])
    assert mx.array_equal(
        _next_logits(loaded.model, probe, restored), _next_logits(loaded.model, probe, row)
    ).item()
    bg.close()


def test_a_layout_mismatch_is_refused_naming_the_difference(engine_data_dir: Path) -> None:
    loaded = load_model("tandem-tiny", engine_data_dir)
    caches = loaded.model.make_cache()
    loaded.model(mx.array([[1, 2, 3]]), cache=caches)
    captured = capture(caches, 3)
    tensors = to_host(captured)
    with pytest.raises(Precondition, match="layout"):
        restore(captured.meta(), tensors, ["kv:rotating:64:0"] * 4)
    with pytest.raises(Precondition, match="codec"):
        restore({**captured.meta(), "codec": "other.v9"}, tensors, captured.layout)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compressed_records_restore_plain_caches_near_the_exact_ones(
    dtype: str, engine_data_dir: Path, client: StoreClient, engine
) -> None:  # noqa: ANN001
    """A prefix record compressed to 8 or 4 bits of affine codes, or 4 or 3 bits of TurboQuant
    codes (record_codec.py), holds a fraction of the exact record's bytes and restores plain
    caches whose next logits are near the exact ones (more bits nearer), never equal to a
    different answer's."""
    loaded = load_model("tandem-tiny", engine_data_dir, dtype)
    ids = mx.array([loaded.tokenizer.encode(TEXT)])
    caches = loaded.model.make_cache()
    loaded.model(ids[:, :-1], cache=caches)
    exact = capture(caches, ids.shape[1] - 1)
    expected = _next_logits(loaded.model, ids[:, -1:], caches).astype(mx.float32)
    width = 2 if dtype == "bfloat16" else 4
    head = int(caches[0].keys.shape[-1])
    forms = {
        # codes of `bits`, plus a scale and a bias (of the KV's dtype) per group of 64
        RecordFormat(8): 8 / 8 + 2 * width / 64,
        RecordFormat(4): 4 / 8 + 2 * width / 64,
        # packed indices in uint32 words, plus a float32 norm per head vector
        RecordFormat(4, Scheme.TURBOQUANT): (-(-head // 8) * 4 + 4) / head,
        RecordFormat(3, Scheme.TURBOQUANT): (-(-head // 10) * 4 + 4) / head,
    }
    errors = {}
    for form, bytes_per_value in forms.items():
        packed = compress(exact, form)
        assert packed.nbytes <= exact.nbytes * bytes_per_value / width * 1.01, form
        key = f"packed-{dtype}-{form.tag}".encode()
        _put(client, packed, key)
        got_record = client.get(key)
        check_restorable(got_record.metadata, got_record.tensors, exact.layout)
        restored = restore(got_record.metadata, got_record.tensors, exact.layout)
        assert [type(c) for c in restored] == [type(c) for c in caches]
        got = _next_logits(loaded.model, ids[:, -1:], restored).astype(mx.float32)
        errors[form.tag] = float(mx.abs(got - expected).max().item())  # type: ignore[arg-type]
        assert mx.argmax(got[0, -1]).item() == mx.argmax(expected[0, -1]).item(), form
    assert 0 < errors["record:affine8"] < errors["record:affine4"] < 1.0, errors
    assert 0 < errors["record:turboquant4"] < errors["record:turboquant3"] < 1.0, errors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_plain_kv_record_restores_with_room_to_the_same_next_logits(
    dtype: str, engine_data_dir: Path, client: StoreClient, engine
) -> None:  # noqa: ANN001
    """A store hit on the host (checkpoints/hit_caches.py): a plain-KV record lands its first
    `keep` positions in planes with room, and continues as the record trimmed to `keep`
    does. Records with rings, recurrent layers or compressed tensors do not qualify."""
    loaded = load_model("tandem-tiny", engine_data_dir, dtype)
    ids = mx.array([loaded.tokenizer.encode(TEXT)])
    caches = loaded.model.make_cache()
    loaded.model(ids[:, :-1], cache=caches)
    tokens = ids.shape[1] - 1
    captured = capture(caches, tokens)
    _put(client, captured, b"room-" + dtype.encode())
    got = client.get(b"room-" + dtype.encode())
    assert plain_kv_only(got.metadata)
    keep = tokens - 5
    roomy = restore_with_room(
        got.metadata,
        got.tensors,
        captured.layout,
        planes_as_they_arrive(got, None, 5.0),
        keep,
        keep + 256,
    )
    assert roomy[0].offset == keep and roomy[0].keys.shape[2] == keep + 256
    trimmed = restore(got.metadata, got.tensors, captured.layout)
    trim_prompt_cache(trimmed, 5)
    rest = ids[:, keep : keep + 3]
    assert mx.array_equal(
        _next_logits(loaded.model, rest, roomy), _next_logits(loaded.model, rest, trimmed)
    ).item()
    for variant in ("tandem-tiny-swa", "tandem-tiny-hybrid"):
        other = load_model(variant, engine_data_dir, dtype)
        other_caches = other.model.make_cache()
        other.model(ids[:, :-1], cache=other_caches)
        assert not plain_kv_only(capture(other_caches, tokens).meta())
    compressed = compress(captured, RecordFormat(8))
    assert not plain_kv_only(compressed.meta())
