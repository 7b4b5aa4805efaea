"""A loaded model without its weights: what the core tells the front of the model it loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_service.protocol.capabilities import Capabilities


@dataclass(frozen=True)
class ModelFacts:
    """A loaded model without its weights: the core sends it to the front (protocol/channel.py)."""

    name: str
    path: str
    digest: str
    config: dict[str, Any]
    context_length: int
    vocab_size: int
    layout: list[str]
    eos_token_ids: list[int]
    dtype: str
    kv_head_dims: tuple[int, ...]
    capabilities: Capabilities = Capabilities()
