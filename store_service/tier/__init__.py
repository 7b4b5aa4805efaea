"""The store's second tier: records shared through a Valkey cluster (docs/scale-out.md).

`SharedTier` is what the rest of the store sees of it (tier.py's `Tier`), so that
`store.py` and `admin.py` need not import the cluster client.
"""

from __future__ import annotations

from typing import Protocol

from store_service.wire import TierStats


class SharedTier(Protocol):
    def stats(self) -> TierStats: ...

    def flush(self, timeout: float = 60.0) -> bool: ...

    def delete(self, record_ikey: bytes, namespace: str, payload_bytes: int) -> None: ...

    def close(self) -> None: ...
