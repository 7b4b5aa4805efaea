"""The random-weight model shapes the benches load (no downloads here), without the gRPC
imports of engine_bench.py: benches that only run MLX import them from here."""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx

from engine_service.model.default_model import build_model_dir
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model

SHAPES = {
    # Random-weight stand-ins for real checkpoints (no downloads here).
    "qwen3-0.6b-shape": {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
    },
    # The 0.6B shape's 28 layers and 8 KV heads, narrow: the host's work a step and a
    # checkpoint round (a Python cost per layer and tensor) measured on a CPU.
    "qwen3-0.6b-layers": {
        "model_type": "qwen3",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 28,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "vocab_size": 4096,
    },
    "llama3-8b-shape": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    },
    # Llama 3.1 8B as published: its rope scaling (Llama3RoPE keeps `_freqs`, the arrays an
    # engine thread could not evaluate before every held array was evaluated at load).
    "llama3.1-8b-shape": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    },
    # LFM2-1.2B: short-convolution recurrent layers and six attention layers (a hybrid whose
    # caches cannot be trimmed: prefix snapshots).
    "lfm2-1.2b-shape": {
        "model_type": "lfm2",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 128000,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 2048,
        "block_ff_dim": 12288,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": True,
        "full_attn_idxs": [2, 5, 8, 10, 12, 14],
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "vocab_size": 65536,
    },
}


# The 0.6B's width with Qwen3-32B's 64 layers: a hit moves the 32B's bytes (256 KiB a position:
# 64 layers of 8 KV heads of 128) through a cheap forward pass; more than 32 layers is more
# than one launch of 64 planes.
SHAPES["qwen3-64-layers-shape"] = {**SHAPES["qwen3-0.6b-shape"], "num_hidden_layers": 64}


def model_spec(spec: str, root: Path, shapes: dict[str, dict] | None = None) -> str:
    """A model spec the engine can load: a shape name (SHAPES) becomes a random-weight
    directory under root (fp32 on the CPU, bf16 on a GPU); anything else is returned as is."""
    shapes = SHAPES if shapes is None else shapes
    if spec not in shapes:
        return spec
    dtype = "float32" if mx.default_device() == mx.cpu else "bfloat16"
    build_model_dir(shapes[spec], root / spec, dtype=dtype)
    return str(root / spec)


def load_shape(spec: str) -> LoadedModel:
    """The model of `model_spec(spec, ...)` loaded in this process (a shape's random weights
    are written to a temporary folder, gone once they are loaded)."""
    with tempfile.TemporaryDirectory() as tmp:
        return load_model(model_spec(spec, Path(tmp)), Path(tmp))
