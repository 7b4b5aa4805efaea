"""A CheckpointStore with the shared tier behind it: Puts copied there (tier.py decides
when), and local misses of Get and Lookup answered from there when it has the record."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from store_service.config import StoreConfig
from store_service.errors import Corrupt, NotFound
from store_service.put_spec import PutSpec
from store_service.records import (
    Lease,
    StoredRecord,
    normalize_namespace,
    prefix_scope,
    record_key,
)
from store_service.store import CheckpointStore
from store_service.tier.tier import Tier
from store_service.wire import LookupQuery, LookupResult, PutResult


class TieredStore(CheckpointStore):
    def __init__(self, config: StoreConfig) -> None:
        super().__init__(config)
        assert config.tier is not None
        try:
            self.shared = Tier(config.tier, self)
            self.tier = self.shared
        except BaseException:
            super().close()
            raise

    def put(self, spec: PutSpec, chunks: Iterable[tuple[int, Any]]) -> PutResult:
        """Stores locally, then hands the record to the tier.

        Raises (besides CheckpointStore.put's):
            TierUnavailable: a write-through record the tier did not take (it is stored
                locally all the same). Overloaded: the namespace is over its tier quota.
        """
        result = super().put(spec, chunks)
        self.shared.after_commit(self.local_record(spec.ikey))
        return result

    def pin(self, namespace: str, key: bytes, ttl_s: int, holder: str, lease_id: str) -> Lease:
        """Takes or renews a lease; a prefix record's first lease first writes it through to
        the tier (Tier.hold: something written through rests on it).

        Raises (besides CheckpointStore.pin's):
            TierUnavailable: the tier did not take it (no lease is taken). Overloaded.
        """
        if not lease_id:
            try:
                record = self.local_record(record_key(normalize_namespace(namespace), key))
            except (NotFound, Corrupt):
                pass  # CheckpointStore.pin answers for it
            else:
                self.shared.hold(record)
        return super().pin(namespace, key, ttl_s, holder, lease_id)

    def open_record(self, namespace: str, key: bytes) -> StoredRecord:
        try:
            return super().open_record(namespace, key)
        except NotFound:
            namespace = normalize_namespace(namespace)
            if not self.shared.fetch(record_key(namespace, key), namespace, key):
                raise
        return super().open_record(namespace, key)

    def lookup(self, query: LookupQuery) -> LookupResult:
        found = super().lookup(query)
        if found.found:
            return found
        namespace = normalize_namespace(query.namespace)
        scope = prefix_scope(namespace, query.model_id, list(query.layout), query.block_size)
        if self.shared.fetch_prefix(scope, list(query.block_hashes), query.kind, namespace):
            return super().lookup(query)
        return found

    def close(self) -> None:
        self.shared.close()
        super().close()
