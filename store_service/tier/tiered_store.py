"""A CheckpointStore with the shared tier behind it: Puts copied there (tier.py decides
when), and local misses of Get and Lookup answered from there when it has the record."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from store_service.config import StoreConfig
from store_service.errors import Corrupt, NotFound
from store_service.put_spec import PutSpec
from store_service.records import StoredRecord, normalize_namespace, prefix_scope, record_key
from store_service.store import CheckpointStore
from store_service.tier.tier import Tier
from store_service.wire import LookupQuery, LookupResult, PutResult

# Records of one GetHeaders call brought over from the tier at once (a chain probes 16).
PARALLEL_FETCHES = 8


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
        self._fetches = ThreadPoolExecutor(PARALLEL_FETCHES, thread_name_prefix="tier-fetch")

    def put(self, spec: PutSpec, chunks: Iterable[tuple[int, Any]]) -> PutResult:
        """Stores locally, then hands the record to the tier.

        Raises (besides CheckpointStore.put's):
            TierUnavailable: a write-through record the tier did not take (it is stored
                locally all the same). Overloaded: the namespace is over its tier quota.
        """
        result = super().put(spec, chunks)
        self.shared.after_commit(self.local_record(spec.ikey))
        return result

    def open_record(self, namespace: str, key: bytes) -> StoredRecord:
        try:
            return super().open_record(namespace, key)
        except NotFound:
            namespace = normalize_namespace(namespace)
            if not self.shared.fetch(record_key(namespace, key), namespace, key):
                raise
        return super().open_record(namespace, key)

    def open_records(
        self, namespace: str, keys: Sequence[bytes]
    ) -> list[StoredRecord | NotFound | Corrupt]:
        """As CheckpointStore's; the records only the tier holds are brought over in
        parallel (a resume's chain after a node's loss: its segments' imports overlap)."""
        out: list[StoredRecord | NotFound | Corrupt] = []
        for key in keys:
            try:
                out.append(super().open_record(namespace, key))
            except (NotFound, Corrupt) as exc:
                out.append(exc)
        pairs = zip(keys, out, strict=True)
        missing = list(dict.fromkeys(k for k, r in pairs if isinstance(r, NotFound)))
        fetched = self._fetches.map(lambda key: self._fetched(namespace, key), missing)
        answers = dict(zip(missing, fetched, strict=True))  # a key asked twice comes over once
        return [answers.get(key, found) for key, found in zip(keys, out, strict=True)]

    def _fetched(self, namespace: str, key: bytes) -> StoredRecord | NotFound | Corrupt:
        try:
            return self.open_record(namespace, key)
        except (NotFound, Corrupt) as exc:
            return exc

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
        self._fetches.shutdown(wait=True)
        self.shared.close()
        super().close()
