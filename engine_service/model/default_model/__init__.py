"""The embedded default models: tiny mlx-lm model directories the project builds itself.

No weights can be downloaded where Tandem is developed and tested, so the engine's default
model is made locally on first use and cached in the data directory: a real mlx-lm
architecture (config.json + safetensors), a 2,048-token byte-level BPE tokenizer and a chat
template, loaded through mlx-lm's own loader like any other model directory. The default,
its draft and the hybrid variant are trained here on the Python standard library's source
(`python -m training`, docs/training.md): their weights and the tokenizer are committed in
`trained/` and checked against their sha256 when a directory is built. The test shapes
(`build_model_dir` without weights) get fixed-seed random weights: only their shapes matter.

Variants (all share the tokenizer):
- `tandem-tiny`: llama, 4 layers, full attention (the default; trained).
- `tandem-tiny-draft`: a 2-layer llama companion for speculative decoding (trained).
- `tandem-tiny-swa`: llama with sliding-window layers (RotatingKVCache; tandem-tiny's
  weights).
- `tandem-tiny-hybrid`: lfm2, short-conv recurrent layers and attention (ArraysCache +
  KVCache; trained).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "tandem-tiny"
VOCAB_SIZE = 2048
SEED = 20261129
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The trained models' committed weights and tokenizer (python -m training; docs/training.md).
TRAINED_DIR = Path(__file__).parent / "trained"
TRAINED_MODELS = ("tandem-tiny", "tandem-tiny-draft", "tandem-tiny-hybrid")
# The sliding-window variant has tandem-tiny's parameters: it serves its weights, attending
# over 64 tokens on half its layers (windowed attention it was not trained with).
SHARED_WEIGHTS = {"tandem-tiny-swa": "tandem-tiny"}
# Bump when the recipe changes so cached directories are rebuilt.
RECIPE_VERSION = "2"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "tandem-tiny": _LLAMA,
    "tandem-tiny-swa": {
        **_LLAMA,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 64,
    },
    "tandem-tiny-hybrid": {
        "model_type": "lfm2",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 256,
        "block_ff_dim": 512,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [1, 3],
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "tandem-tiny-draft": {
        **_LLAMA,
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "head_dim": 32,
    },
}


def is_embedded(name: str) -> bool:
    return name in CONFIGS


def ensure_model(name: str, cache_dir: Path) -> Path:
    """The directory of embedded model `name`, built on first use (atomically)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown embedded model {name!r}; known: {sorted(CONFIGS)}")
    config = {**CONFIGS[name], "tandem_embedded": f"{name}-v{RECIPE_VERSION}"}
    trained = SHARED_WEIGHTS.get(name, name)
    weights = TRAINED_DIR / f"{trained}.safetensors" if trained in TRAINED_MODELS else None
    return build_once(config, cache_dir / f"{name}-v{RECIPE_VERSION}", weights)


def build_once(config: dict[str, Any], target: Path, weights: Path | None = None) -> Path:
    """`target`, a model directory built from config on first use: in a staging directory
    renamed into place, so concurrent builders (test workers, engines) share one build."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build_model_dir(config, staging, weights=weights)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent builder's win
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_model_dir(
    config: dict[str, Any], out: Path, dtype: str = "float32", weights: Path | None = None
) -> None:
    """Writes an mlx-lm model directory: config, the committed tokenizer, and the trained
    `weights` (checked against trained/SHA256SUMS) or fixed-seed random weights.

    Also used by tests to make directories shaped like hub models (e.g. a bf16 qwen3).
    """
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(verified(TRAINED_DIR / "tokenizer.json"), out / "tokenizer.json")
    vocab_json = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab_json}
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": config.get("max_position_embeddings", 8192),
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
            },
            indent=2,
        )
    )
    # A config may ask for a larger embedding than the tokenizer (benchmark shapes): the
    # extra ids exist in the model but decode to nothing.
    vocab = max(int(config.get("vocab_size", VOCAB_SIZE)), VOCAB_SIZE)
    if weights is not None:
        dtype = "float16"  # as trained weights are committed
    config = {**config, "vocab_size": vocab, "eos_token_id": eos, "torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if weights is not None:
        shutil.copyfile(verified(weights), out / "model.safetensors")
    else:
        _write_weights(config, out, dtype)


def verified(path: Path) -> Path:
    """path, once its sha256 matches trained/SHA256SUMS (a damaged or hand-edited file of the
    committed model is refused, never served)."""
    lines = (TRAINED_DIR / "SHA256SUMS").read_text().splitlines()
    sums = {name: digest for digest, name in (line.split() for line in lines)}
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if sums.get(path.name) != digest:
        raise ValueError(f"{path} does not match its sha256 in {TRAINED_DIR / 'SHA256SUMS'}")
    return path


def _write_weights(config: dict[str, Any], out: Path, dtype: str) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine_service.model.mlx_compat import model_classes

    model_class, args_class = model_classes(config)
    mx.random.seed(SEED)
    model = model_class(args_class.from_dict(config))
    target = getattr(mx, dtype)
    params: Any = tree_flatten(model.parameters())
    weights = {k: v.astype(target) for k, v in params}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
