"""Loading a model through mlx-lm's loader, and what identifies it and its cache layout."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as cache_lib
from mlx_lm.utils import load

from engine_service.config import missing_model_directory
from engine_service.kv import attention_routing
from engine_service.model import upstream_fixes
from engine_service.model.default_model import DEFAULT_MODEL, ensure_model, is_embedded
from engine_service.model.loaded import LoadedModel
from engine_service.model.mlx_compat import download
from engine_service.protocol.capabilities import from_layout
from engine_service.protocol.kv_codec import storage_signature

log = logging.getLogger(__name__)


def layout_codec(cache: Any) -> str:
    """The codec id of one layer's cache, as DESIGN.md's layout signature names them."""
    layout_id = getattr(cache, "layout_id", None)  # a packed ring row (kv/rows.py)
    if layout_id is not None:
        return str(layout_id)
    stored = getattr(cache, "stored_as", None)  # a TurboQuant row (kv/rows.py)
    if stored is not None:
        return storage_signature(stored)
    if isinstance(cache, cache_lib.QuantizedKVCache):
        return f"kv:quant:{cache.bits}:{cache.group_size}"
    if isinstance(cache, cache_lib.RotatingKVCache):
        return f"kv:rotating:{cache.max_size}:{cache.keep}"
    if isinstance(cache, cache_lib.ChunkedKVCache):
        return f"kv:chunked:{cache.chunk_size}"
    if isinstance(cache, cache_lib.KVCache):
        return "kv:plain"
    if isinstance(cache, cache_lib.ArraysCache):
        return f"ssm:arrays:{len(cache.cache)}"
    if isinstance(cache, cache_lib.CacheList):
        return "list(" + ",".join(layout_codec(c) for c in cache.caches) + ")"
    return f"other:{type(cache).__name__}"


def _digest(path: Path) -> str:
    """sha256 over config and weight files (name, size, bytes), cached beside nothing:
    weights are read once per start; for multi-GB models this is seconds of I/O."""
    files = sorted(
        [path / "config.json", *path.glob("*.safetensors"), *path.glob("tokenizer.json")]
    )
    h = hashlib.sha256()
    for file in files:
        if not file.exists():
            continue
        h.update(file.name.encode())
        h.update(str(file.stat().st_size).encode())
        with open(file, "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
    return "sha256:" + h.hexdigest()[:16]


def resolve(spec: str, data_dir: Path) -> tuple[str, Path]:
    """A model name and its local directory: embedded, a local path, or a hub id."""
    spec = spec or DEFAULT_MODEL
    if is_embedded(spec):
        return spec, ensure_model(spec, data_dir / "models")
    path = Path(spec).expanduser()
    if path.exists():
        return path.resolve().name, path
    if missing_model_directory(spec):  # a path, not a hub id: never asked of the hub
        raise FileNotFoundError(missing_model_directory(spec))
    return spec, download(spec)


def load_model(spec: str, data_dir: Path, dtype: str = "auto") -> LoadedModel:
    name, path = resolve(spec, data_dir)
    model, tokenizer, config = load(str(path), return_config=True)  # type: ignore[misc]
    attention_routing.install()  # TurboQuant rows' attention (the model's module is loaded now)
    upstream_fixes.apply(model)  # mlx-lm defects our batches would hit (nemotron_h's lengths)
    if dtype == "auto":
        # CPU matmuls in bf16/fp16 do not use BLAS and run far slower than fp32.
        dtype = "float32" if mx.default_device() == mx.cpu else ""
    if dtype:
        target = getattr(mx, dtype)
        model.set_dtype(target, lambda t: mx.issubdtype(t, mx.floating))
    # Materialize now: a lazy array would be evaluated on the engine thread, which cannot
    # run graphs recorded on this thread's default stream. Not only the parameters: scaled
    # rope classes (Llama 3, longrope, yarn) keep their frequencies in private attributes.
    mx.eval(held_arrays(model))
    params_dtype = _param_dtype(model)
    make = getattr(model, "make_cache", None)
    caches = make() if make else cache_lib.make_prompt_cache(model)
    context = int(
        config.get("max_position_embeddings")
        or config.get("max_sequence_length")
        or getattr(tokenizer, "model_max_length", 0)
        or 4096
    )
    vocab = min(len(tokenizer), int(config.get("vocab_size", len(tokenizer))))
    eos = sorted(int(t) for t in tokenizer.eos_token_ids)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        path=path,
        digest=_digest(path),
        config=config,
        context_length=context,
        vocab_size=vocab,
        layout=[layout_codec(c) for c in caches],
        eos_token_ids=eos,
        dtype=params_dtype,
        kv_head_dims=_kv_head_dims(model, config),
    )
    loaded.capabilities = from_layout(loaded.layout, loaded.kv_head_dims)
    log.info(
        "loaded %s (%s) from %s: %s, context %d, layout %s",
        loaded.model_id,
        config.get("model_type"),
        path,
        params_dtype,
        context,
        ",".join(loaded.layout),
    )
    return loaded


class IncompatibleDraft(ValueError):
    """A draft model that cannot propose tokens for the target."""


def load_draft(spec: str, data_dir: Path, target: LoadedModel, dtype: str = "auto") -> LoadedModel:
    """A draft model for speculative decoding: same tokenizer (vocabulary and ids) as the
    target, and caches that can be trimmed (rejected drafts are rolled back)."""
    draft = load_model(spec, data_dir, dtype)
    if draft.vocab_size != target.vocab_size:
        raise IncompatibleDraft(
            f"draft {draft.model_id} has {draft.vocab_size} tokens, "
            f"target {target.model_id} has {target.vocab_size}"
        )
    probe = "The quick brown fox, 12345 ünïcödé <|im_start|>"
    if draft.tokenizer.encode(probe) != target.tokenizer.encode(probe):
        raise IncompatibleDraft(f"draft {draft.model_id} tokenizes differently from the target")
    untrimmable = sorted({c for c in draft.layout if c != "kv:plain"})
    if untrimmable:
        raise IncompatibleDraft(f"draft {draft.model_id} has untrimmable layers {untrimmable}")
    return draft


def held_arrays(model: Any) -> list[mx.array]:
    """Every array a model holds: its parameters and its modules' private arrays
    (`parameters()` leaves out names that start with an underscore)."""
    from mlx.utils import tree_flatten

    def holds(_module: Any, _key: str, value: Any) -> bool:
        return isinstance(value, (mx.array, dict, list, tuple))  # a Module is a dict

    leaves: Any = tree_flatten(model.filter_and_map(holds))
    return [value for _, value in leaves if isinstance(value, mx.array)]


def _kv_head_dims(model: Any, config: dict[str, Any]) -> tuple[int, ...]:
    args = getattr(model, "args", None)
    text = config.get("text_config", config)
    head = getattr(args, "head_dim", None) or text.get("head_dim")
    if not head:
        heads = text.get("num_attention_heads") or getattr(args, "num_attention_heads", 0)
        hidden = text.get("hidden_size") or getattr(args, "hidden_size", 0)
        head = hidden // heads if heads else 0
    dims = {int(head)} if head else set()
    for name in ("v_head_dim", "qk_head_dim", "kv_lora_rank"):  # models with uneven heads
        if text.get(name):
            dims.add(int(text[name]))
    return tuple(sorted(dims))


def _param_dtype(model: Any) -> str:
    from mlx.utils import tree_flatten

    params: Any = tree_flatten(model.parameters())
    for _, value in params:
        if mx.issubdtype(value.dtype, mx.floating):
            return str(value.dtype).removeprefix("mlx.core.")
    return "unknown"


def config_json(loaded: LoadedModel) -> str:
    return json.dumps(loaded.config, sort_keys=True)
