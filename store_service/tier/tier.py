"""The store's second tier: what goes to the Valkey cluster and when, and what comes back.

- Generation checkpoints and objects (segments, attachments) are written through: with
  durability `tier` or `replicated` the Put is answered only once the tier holds them
  (UNAVAILABLE when it does not; the record is then in the local tier only).
- Prefix records (and everything, with durability `local`) are written behind, from a
  bounded, deduplicated queue; what does not fit is dropped and counted.
- A Get or Lookup that misses locally asks the tier; a record found there is checked chunk
  by chunk, stored locally (so region Gets and later hits are local) and served from there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from store_service.errors import Corrupt, InvalidRequest, NotFound, Overloaded
from store_service.put_spec import PutSpec
from store_service.records import KIND_PREFIX, StoredRecord
from store_service.store import CheckpointStore
from store_service.tier.cluster_client import ClusterClient, NotReplicated, TierUnavailable
from store_service.tier.config import Durability, TierConfig
from store_service.tier.records import Manifest, TierRecords
from store_service.tier.write_behind import WriteBehind
from store_service.wire import TierStats

log = logging.getLogger(__name__)

# While the cluster does not answer, one call in this many seconds tries it; the rest are
# a miss (reads) or UNAVAILABLE (write-through) at once, so nothing waits on a dead tier.
RETRY_S = 1.0
# Records that did not reach the tier while it was down, copied once it answers again.
MAX_MISSED = 100_000


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    written: int = 0
    written_bytes: int = 0
    write_seconds: float = 0.0
    read_bytes: int = 0
    read_seconds: float = 0.0
    errors: int = 0  # calls the cluster did not answer
    damaged: int = 0  # records found whole-or-damaged: a chunk missing or failing its CRC
    quota_refusals: int = 0
    deleted: int = 0


class Tier:
    """One store's use of the shared tier."""

    def __init__(self, config: TierConfig, store: CheckpointStore) -> None:
        self.config = config
        self.store = store
        self.client = ClusterClient(config)
        self.records = TierRecords(self.client, config.ttl_s)
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self.namespace_bytes: dict[str, int] = defaultdict(int)
        self.up = True
        self._retry_at = 0.0
        self._missed: OrderedDict[bytes, int] = OrderedDict()  # ikey -> payload bytes
        self.behind = WriteBehind(self._copy_behind, config.write_behind_bytes)
        log.info("shared tier: %s", config.describe())

    @property
    def replicas(self) -> int:
        return 1 if self.config.durability == Durability.REPLICATED else 0

    # -- writes ------------------------------------------------------------------------------

    def after_commit(self, record: StoredRecord) -> None:
        """Called once a Put is committed locally.

        Raises:
            TierUnavailable: write-through and the cluster did not take it.
            Overloaded: write-through and the namespace is over its tier quota.
        """
        through = record.header.kind != KIND_PREFIX and self.config.durability != Durability.LOCAL
        if through:
            self._write(record, through=True)
        else:
            self.behind.offer(record.ikey, record.payload_bytes)

    def hold(self, record: StoredRecord) -> None:
        """A prefix record being pinned: an engine's generation checkpoint chain rests on it
        (docs/checkpoints.md), and the chain's own records are written through, so it is too
        (unless the tier holds it already, or durability is `local`): written behind, it
        could still be in this store's queue when the node is lost, and the generation with
        it.

        Raises:
            TierUnavailable: the cluster did not take it. Overloaded: the namespace is over
                its tier quota.
        """
        if record.header.kind != KIND_PREFIX or self.config.durability == Durability.LOCAL:
            return
        if self._reachable():
            try:
                if self.records.manifest(record.ikey) is not None:
                    return
            except Corrupt:
                pass  # written again below
            except TierUnavailable as exc:
                self._count_error(exc)
        self._write(record, through=True)

    def _copy_behind(self, ikey: bytes) -> None:
        try:
            record = self.store.local_record(ikey)
        except (NotFound, Corrupt):
            return  # evicted or replaced before its turn: nothing to copy
        try:
            self._write(record, through=False)
        except (TierUnavailable, Overloaded):
            pass  # counted in _write

    def _write(self, record: StoredRecord, through: bool) -> None:
        namespace = record.header.namespace
        quota = self.config.namespace_quota_bytes
        with self._lock:
            if quota and self.namespace_bytes[namespace] + record.payload_bytes > quota:
                self.counters.quota_refusals += 1
                raise Overloaded(
                    f"namespace {namespace!r} holds {self.namespace_bytes[namespace]} bytes in "
                    f"the shared tier; its quota is {quota}"
                )
        if not self._reachable():
            self._remember_missed(record)
            with self._lock:
                self.counters.errors += 1
            raise TierUnavailable("the shared tier is not answering (see the store's log)")
        started = time.perf_counter()
        # One piece per stored chunk: the tier keeps the local chunk layout and its CRCs.
        chunks = list(self.store.read_payload(record, 0, _whole_chunk))
        try:
            written = self.records.write(record, chunks, self.replicas)
        except NotReplicated as exc:
            # The primaries hold it and answered: the tier is up, a replica is missing.
            with self._lock:
                self.counters.errors += 1
            raise TierUnavailable(
                f"the shared tier did not replicate the checkpoint: {exc}"
            ) from exc
        except TierUnavailable as exc:
            self._count_error(exc)
            self._remember_missed(record)
            if through:
                raise TierUnavailable(
                    f"the shared tier did not take the checkpoint: {exc}"
                ) from exc
            raise
        self._mark_up()
        with self._lock:
            self.counters.written += 1
            self.counters.written_bytes += written
            self.counters.write_seconds += time.perf_counter() - started
            self.namespace_bytes[namespace] += record.payload_bytes

    def delete(self, record_ikey: bytes, namespace: str, payload_bytes: int) -> None:
        """Removes a record from the tier too (a finished generation, an operator's
        Delete); a tier that does not answer leaves it to its TTL."""
        try:
            if self.records.delete(record_ikey):
                with self._lock:
                    self.counters.deleted += 1
                    left = self.namespace_bytes[namespace] - payload_bytes
                    self.namespace_bytes[namespace] = max(0, left)
        except TierUnavailable as exc:
            with self._lock:
                self.counters.errors += 1
            log.warning("deleting a record from the shared tier failed (its TTL will): %s", exc)

    # -- reads -------------------------------------------------------------------------------

    def fetch(self, ikey: bytes, namespace: str, key: bytes) -> bool:
        """Brings the record under ikey from the tier into the local one; False if the tier
        has none (or not whole). Never raises for the tier's failures: a miss."""
        if not self._reachable():
            return False
        try:
            manifest = self.records.manifest(ikey)
        except Corrupt as exc:
            self._count_damaged(exc)
            return False
        except TierUnavailable as exc:
            self._count_error(exc)
            return False
        self._mark_up()
        header = manifest.record.header if manifest is not None else None
        if header is None or header.namespace != namespace or bytes(header.key) != key:
            with self._lock:
                self.counters.misses += 1
            return False
        return self._import(manifest)  # type: ignore[arg-type]

    def fetch_prefix(self, scope: bytes, hashes: list[bytes], kind: int, namespace: str) -> bool:
        """Brings the tier's longest prefix record for the chain into the local tier."""
        if not self._reachable():
            return False
        try:
            candidates = self.records.find_prefix(scope, hashes)
            self._mark_up()
            for ikey in candidates:
                manifest = self.records.manifest(ikey)
                if manifest is None:
                    continue
                header = manifest.record.header
                if header.namespace != namespace or header.kind != kind:
                    continue  # a record of another tenant is never served
                if self._import(manifest):
                    return True
        except Corrupt as exc:
            self._count_damaged(exc)
            return False
        except TierUnavailable as exc:
            self._count_error(exc)
            return False
        with self._lock:
            self.counters.misses += 1
        return False

    def _import(self, manifest: Manifest) -> bool:
        started = time.perf_counter()
        record = manifest.record
        spec = PutSpec.validated(record.header)
        try:
            # The local store's own put: a record from the tier is not handed back to it.
            CheckpointStore.put(self.store, spec, _pieces(self.records.read(manifest)))
        except (Corrupt, InvalidRequest) as exc:  # a chunk missing, damaged or mis-sized
            self._count_damaged(exc)
            return False
        except TierUnavailable as exc:
            self._count_error(exc)
            return False
        self._mark_up()
        with self._lock:
            self.counters.hits += 1
            self.counters.read_bytes += record.payload_bytes
            self.counters.read_seconds += time.perf_counter() - started
        return True

    def _count_damaged(self, exc: Exception) -> None:
        with self._lock:
            self.counters.damaged += 1
        log.error("a record in the shared tier is damaged, not served: %s", exc)

    def _count_error(self, exc: Exception) -> None:
        with self._lock:
            self.counters.errors += 1
            was_up, self.up = self.up, False
            self._retry_at = time.monotonic() + RETRY_S
        if was_up:  # once an outage, not once a call
            log.warning("the shared tier stopped answering (local only until it does): %s", exc)

    def _remember_missed(self, record: StoredRecord) -> None:
        with self._lock:
            self._missed[record.ikey] = record.payload_bytes
            if len(self._missed) > MAX_MISSED:
                self._missed.popitem(last=False)

    def _mark_up(self) -> None:
        """The cluster answered: what it missed while down is queued for it again."""
        with self._lock:
            if self.up:
                return
            self.up = True
            missed, self._missed = self._missed, OrderedDict()
        log.info("the shared tier answers again; %d records to catch up", len(missed))
        for ikey, size in missed.items():
            self.behind.offer(ikey, size)

    def _reachable(self) -> bool:
        """Up, or down but due for another try (which this call makes)."""
        with self._lock:
            if self.up:
                return True
            now = time.monotonic()
            if now < self._retry_at:
                return False
            self._retry_at = now + RETRY_S
            return True

    def stats(self) -> TierStats:
        with self._lock:
            c = self.counters
            return TierStats(
                up=self.up,
                durability=self.config.durability.value,
                queue_depth=self.behind.depth,
                queued_bytes=self.behind.queued_bytes,
                dropped=self.behind.dropped,
                **vars(c),
            )

    def flush(self, timeout: float = 60.0) -> bool:
        """Until the write-behind queue is empty; False if it did not empty in time."""
        return self.behind.wait_idle(timeout)

    def close(self) -> None:
        self.behind.close()
        self.client.close()


def _whole_chunk(offset: int, view: memoryview) -> bytes:
    return bytes(view)


def _pieces(chunks: Iterator[bytes]) -> Iterator[tuple[int, bytes]]:
    offset = 0
    for chunk in chunks:
        yield offset, chunk
        offset += len(chunk)
