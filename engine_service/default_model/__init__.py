"""The embedded default models: tiny mlx-lm model directories the project builds itself.

No weights can be downloaded where Tandem is developed and tested, so the engine's default
model is made locally on first use and cached in the data directory: a real mlx-lm
architecture (config.json + safetensors with fixed-seed random weights), a real byte-level
BPE tokenizer trained with `tokenizers` on a small committed corpus, and a chat template.
It is loaded through mlx-lm's own loader like any other model directory.

Variants (all share the tokenizer):
- `tandem-tiny`: llama, 4 layers, full attention (the default).
- `tandem-tiny-swa`: llama with sliding-window layers (RotatingKVCache).
- `tandem-tiny-hybrid`: lfm2, short-conv recurrent layers and attention (ArraysCache + KVCache).
- `tandem-tiny-draft`: a 2-layer llama companion for speculative decoding.
"""

from __future__ import annotations

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
# Bump when the recipe changes so cached directories are rebuilt.
RECIPE_VERSION = "1"

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
    return build_once(config, cache_dir / f"{name}-v{RECIPE_VERSION}")


def build_once(config: dict[str, Any], target: Path) -> Path:
    """`target`, a model directory built from config on first use: in a staging directory
    renamed into place, so concurrent builders (test workers, engines) share one build."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build_model_dir(config, staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent builder's win
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_model_dir(config: dict[str, Any], out: Path, dtype: str = "float32") -> None:
    """Writes an mlx-lm model directory: config, fixed-seed random weights, tokenizer.

    Also used by tests to make directories shaped like hub models (e.g. a bf16 qwen3).
    """
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
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
    config = {**config, "vocab_size": vocab, "eos_token_id": eos, "torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(config, out, dtype)


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = (Path(__file__).parent / "corpus.txt").read_text(encoding="utf-8")
    tokenizer.train_from_iterator(corpus.splitlines(), trainer=trainer)
    return tokenizer


def _write_weights(config: dict[str, Any], out: Path, dtype: str) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine_service.mlx_compat import model_classes

    model_class, args_class = model_classes(config)
    mx.random.seed(SEED)
    model = model_class(args_class.from_dict(config))
    target = getattr(mx, dtype)
    params: Any = tree_flatten(model.parameters())
    weights = {k: v.astype(target) for k, v in params}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
