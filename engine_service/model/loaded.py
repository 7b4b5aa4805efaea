"""`LoadedModel`: a model and its tokenizer, and the front's tokenizer view of it.

The core holds the weights (model/loading.py loads them); the front builds the same
tokenizer from the facts the core sends (`without_weights`) and never imports the batch,
its caches or mlx-lm's generation code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from engine_service.protocol.capabilities import Capabilities
from engine_service.protocol.model_facts import ModelFacts


@dataclass
class LoadedModel:
    model: Any  # an mlx.nn.Module (None in the gRPC front: without_weights)
    tokenizer: TokenizerWrapper
    name: str
    path: Path
    digest: str
    config: dict[str, Any]
    context_length: int
    vocab_size: int  # token ids the tokenizer knows: valid inputs are [0, vocab_size)
    layout: list[str]
    eos_token_ids: list[int]
    dtype: str
    # Key and value head widths of the attention layers (what a KV group size must divide).
    kv_head_dims: tuple[int, ...] = ()
    # What its caches do here: set by the core's probe on the MLX thread before it serves.
    capabilities: Capabilities = field(default_factory=Capabilities)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_id(self) -> str:
        return f"{self.name}@{self.digest}"

    def facts(self) -> ModelFacts:
        """What the gRPC front needs to know of the model the engine core loaded."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelFacts)}
        return ModelFacts(**{**shared, "path": str(self.path)})


def without_weights(facts: ModelFacts) -> LoadedModel:
    """The front's view of the core's model: the same tokenizer, no weights (model None).

    The front validates, tokenizes and detokenizes; only the core runs the model."""
    path = Path(facts.path)
    tokenizer = load_tokenizer(path, eos_token_ids=facts.config.get("eos_token_id"))
    shared = {f.name: getattr(facts, f.name) for f in dataclasses.fields(ModelFacts)}
    return LoadedModel(model=None, tokenizer=tokenizer, **{**shared, "path": path})
