"""The engine's limits and defaults that the front validates and completes requests against."""

from __future__ import annotations

from dataclasses import dataclass

from engine_service.model.loaded import LoadedModel
from engine_service.protocol.kv_codec import PLAIN_KV, KVCodec
from engine_service.protocol.requests import DraftSupport


@dataclass(frozen=True)
class RequestPolicy:
    """The engine's limits and defaults that a request is validated and completed against."""

    loaded: LoadedModel
    context: int
    default_max_tokens: int
    has_store: bool = False
    default_checkpoint_interval: int = 0
    default_kv: KVCodec = PLAIN_KV
    drafts: DraftSupport = DraftSupport()
    deterministic: bool = False  # --deterministic (ModelInfo says so)
