"""Model loading through mlx-lm's loader: a hub-shaped directory, and the embedded variants."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engine_service.model.default_model import build_model_dir
from engine_service.protocol.kv_codec import KVCodec
from tandem_client import EngineClient
from tests.batch_rows import alone
from tests.servers import start_engine

QWEN3_SHAPE = {
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def _greedy(model, ids: list[int], n: int) -> list[int]:  # noqa: ANN001
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def _greedy_kv8(model, ids: list[int], n: int) -> list[int]:  # noqa: ANN001
    """Solo greedy decoding with 8-bit plain KV layers, converted after each call as
    mlx-lm's maybe_quantize_kv_cache does; recurrent layers stay as they are."""
    cache = make_prompt_cache(model)

    def call(tokens: list[int]) -> mx.array:
        logits: mx.array = model(mx.array([tokens]), cache=cache)
        for i, c in enumerate(cache):
            if type(c) is KVCache:
                cache[i] = c.to_quantized(group_size=64, bits=8)
        return logits[0, -1]

    call(ids[:-1])
    out, token = [], ids[-1]
    for _ in range(n):
        top = mx.argmax(call([token])).item()
        assert isinstance(top, int)  # argmax: an index
        token = top
        out.append(token)
    return out


def test_a_hub_shaped_bf16_directory_loads_and_serves(
    tmp_path: Path, engine_data_dir: Path
) -> None:
    model_dir = tmp_path / "Qwen3-Tiny-bf16"
    build_model_dir(QWEN3_SHAPE, model_dir, dtype="bfloat16")
    proc = start_engine(engine_data_dir, "--model", str(model_dir), log_dir=tmp_path)
    try:
        with EngineClient(proc.address) as client:
            info = client.model_info()
            assert info.name == "Qwen3-Tiny-bf16" and info.model_type == "qwen3"
            assert info.model_id.startswith("Qwen3-Tiny-bf16@sha256:")
            assert info.dtype == "float32"  # CPU default: fp32 compute
            assert info.context_length == 4096
            ids = client.tokenize("Hello world")
            got = client.generate(ids, max_tokens=16, ignore_eos=True)
        model = load(str(model_dir))[0]
        model.set_dtype(mx.float32, lambda t: mx.issubdtype(t, mx.floating))
        assert got.token_ids == _greedy(model, ids, 16)
    finally:
        proc.stop()


@pytest.mark.parametrize(
    "variant,layout",
    [
        ("tandem-tiny-swa", ["kv:rotating:64:0", "kv:plain"] * 2),
        ("tandem-tiny-hybrid", ["ssm:arrays:1", "kv:plain"] * 2),
    ],
)
def test_embedded_variants_serve(
    variant: str, layout: list[str], engine_data_dir: Path, tmp_path: Path
) -> None:
    proc = start_engine(engine_data_dir, "--model", variant, log_dir=tmp_path)
    try:
        with EngineClient(proc.address) as client:
            info = client.model_info()
            assert list(info.layout) == layout
            ids = client.tokenize("The quick brown fox jumps over the lazy dog " * 12)
            got = client.generate(ids, max_tokens=24, ignore_eos=True)
            # 8-bit KV: plain and sliding-window KV layers quantize, recurrent ones stay.
            quantized = client.generate(ids, max_tokens=24, ignore_eos=True, kv_bits=8)
        model_dir = next((engine_data_dir / "models").glob(f"{variant}-v*"))
        model = load(str(model_dir))[0]
        # The engine runs fp32 on the CPU (--dtype auto); the committed weights are fp16.
        model.set_dtype(mx.float32, lambda t: mx.issubdtype(t, mx.floating))
        assert got.token_ids == _greedy(model, ids, 24)
        if variant.endswith("-swa"):  # mlx-lm cannot quantize a ring: our rows, alone
            assert quantized.token_ids == alone(model, ids, 24, KVCodec(8, 64, 0))[0]
        else:
            assert quantized.token_ids == _greedy_kv8(model, ids, 24)
    finally:
        proc.stop()
