"""Python client for Tandem: the store and engine clients, prompt identity, the `tandem` CLI."""

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
    LookupResult,
    PutResult,
    RecordSummary,
    StoreClient,
    Tensor,
)
from tandem_client.tools import ToolCall

__all__ = [
    "AlreadyExists",
    "AsyncEngineClient",
    "AsyncStoreClient",
    "Checkpoint",
    "DataLoss",
    "EngineClient",
    "Generation",
    "GenerationChunk",
    "ToolCall",
    "FailedPrecondition",
    "InvalidArgument",
    "LookupResult",
    "NotFound",
    "PutResult",
    "RecordSummary",
    "ResourceExhausted",
    "StoreClient",
    "TandemError",
    "Tensor",
    "Unavailable",
]
