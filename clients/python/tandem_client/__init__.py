"""Python client for Tandem: the store and engine clients, prompt identity, the `tandem` CLI.

The names below load on first use (PEP 562): `import tandem_client.credentials` (the
gateway) or the CLI's `generate` then pay only for what they use, not for the asyncio
clients, the store client and numpy (about 0.1-0.2 s of every process start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names are, for type checkers and readers
    from tandem_client.aio import AsyncEngineClient, AsyncStoreClient
    from tandem_client.engine_client import EngineClient, Generation, GenerationChunk
    from tandem_client.errors import (
        AlreadyExists,
        DataLoss,
        FailedPrecondition,
        InvalidArgument,
        NotFound,
        ResourceExhausted,
        TandemError,
        Unavailable,
    )
    from tandem_client.store_client import (
        Checkpoint,
        HeaderRead,
        LookupResult,
        PutResult,
        RecordSummary,
        StoreClient,
        Tensor,
    )
    from tandem_client.tools import ToolCall

_HOME = {
    "AsyncEngineClient": "aio",
    "AsyncStoreClient": "aio",
    "EngineClient": "engine_client",
    "Generation": "engine_client",
    "GenerationChunk": "engine_client",
    "AlreadyExists": "errors",
    "DataLoss": "errors",
    "FailedPrecondition": "errors",
    "InvalidArgument": "errors",
    "NotFound": "errors",
    "ResourceExhausted": "errors",
    "TandemError": "errors",
    "Unavailable": "errors",
    "Checkpoint": "store_client",
    "HeaderRead": "store_client",
    "LookupResult": "store_client",
    "PutResult": "store_client",
    "RecordSummary": "store_client",
    "StoreClient": "store_client",
    "Tensor": "store_client",
    "ToolCall": "tools",
}
__all__ = [
    "AlreadyExists",
    "AsyncEngineClient",
    "AsyncStoreClient",
    "Checkpoint",
    "DataLoss",
    "EngineClient",
    "FailedPrecondition",
    "Generation",
    "GenerationChunk",
    "InvalidArgument",
    "HeaderRead",
    "LookupResult",
    "NotFound",
    "PutResult",
    "RecordSummary",
    "ResourceExhausted",
    "StoreClient",
    "TandemError",
    "Tensor",
    "ToolCall",
    "Unavailable",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'tandem_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tandem_client.{home}"), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
