"""The store's Prometheus metrics (`--metrics-listen`): its StoreStats read at scrape time,
under `tandem:store_*` names."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from store_service.wire import StoreStats

GAUGES = {
    "records": "Records held.",
    "payload_bytes": "Payload bytes held.",
    "capacity_bytes": "The byte budget (--capacity).",
    "file_bytes": "The LMDB file's size.",
    "map_size_bytes": "LMDB's map size.",
    "pinned_records": "Records under a lease.",
    "pending_puts": "Puts in progress.",
    "pending_bytes": "Bytes of Puts in progress.",
    "quarantined": "Records quarantined for damage.",
    "regions": "Same-host shared-memory regions registered.",
}
COUNTERS = {
    "hits": "Lookups and Gets that found their record.",
    "misses": "Lookups and Gets that found nothing.",
    "evictions": "Records evicted for room.",
    "evicted_bytes": "Bytes evicted for room.",
    "puts": "Records written.",
    "gets": "Records read.",
    "orphans_collected": "Chunks of unfinished writes collected.",
    "map_resizes": "LMDB map growths.",
}
# The shared tier's (with --tier), as tandem:store_tier_*.
TIER_GAUGES = {
    "up": "1 while the tier's cluster answers.",
    "queue_depth": "Records waiting to be written behind.",
    "queued_bytes": "Bytes waiting to be written behind.",
}
TIER_COUNTERS = {
    "hits": "Local misses answered from the tier.",
    "misses": "Local misses the tier could not answer either.",
    "read_bytes": "Bytes brought from the tier.",
    "read_seconds": "Seconds spent bringing records from the tier.",
    "written": "Records written to the tier.",
    "written_bytes": "Bytes written to the tier.",
    "write_seconds": "Seconds spent writing to the tier.",
    "dropped": "Prefix records not queued for the tier (the queue was full).",
    "errors": "Calls the tier's cluster did not answer, or did not replicate.",
    "damaged": "Records found damaged in the tier (a miss, never served).",
    "quota_refusals": "Writes refused over a namespace's tier quota.",
    "deleted": "Records deleted from the tier.",
}


SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(12))  # 1 KiB .. 4 GiB


class TransferPath(enum.Enum):
    STREAM = "stream"
    REGION = "region"
    INLINE = "inline"  # a Put's payload inside its one message (Store.PutRecords)
    DIRECT = "direct"  # read by the caller out of the data file (direct_reads.py)


class TransferMetrics:
    """Put and Get sizes and times, observed by the servicer as each call ends. One set per
    process (a registry of its own), served by --metrics-listen when it is given."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        # path: "stream" (bytes on the gRPC stream), "region" (the same-host shared memory) or
        # "direct" (read by the caller out of the data file).
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["path"], buckets=buckets, registry=self.registry)

        self.put_seconds = histogram(
            "tandem:store_put_seconds", "A Put, first byte to commit.", SECONDS_BUCKETS
        )
        self.put_bytes = histogram("tandem:store_put_bytes", "A Put's payload.", BYTES_BUCKETS)
        self.get_seconds = histogram(
            "tandem:store_get_seconds", "A Get, open to last byte.", SECONDS_BUCKETS
        )
        self.get_bytes = histogram("tandem:store_get_bytes", "A Get's payload.", BYTES_BUCKETS)

    def put(self, path: TransferPath, seconds: float, nbytes: int) -> None:
        self.put_seconds.labels(path.value).observe(seconds)
        self.put_bytes.labels(path.value).observe(nbytes)

    def get(self, path: TransferPath, seconds: float, nbytes: int) -> None:
        self.get_seconds.labels(path.value).observe(seconds)
        self.get_bytes.labels(path.value).observe(nbytes)


TRANSFERS = TransferMetrics()


class StoreCollector(Collector):
    def __init__(self, read: Callable[[], StoreStats], auth_failures: Callable[[], int]) -> None:
        self.read = read
        self.auth_failures = auth_failures

    def collect(self) -> Iterator[Any]:
        stats = self.read()
        for name, documentation in GAUGES.items():
            yield GaugeMetricFamily(f"tandem:store_{name}", documentation, getattr(stats, name))
        for name, documentation in COUNTERS.items():
            yield CounterMetricFamily(
                f"tandem:store_{name}", documentation, value=getattr(stats, name)
            )
        yield CounterMetricFamily(
            "tandem:store_auth_failures",
            "Calls refused UNAUTHENTICATED.",
            value=self.auth_failures(),
        )
        if stats.tier is not None:
            tier = stats.tier
            for name, documentation in TIER_GAUGES.items():
                value = float(getattr(tier, name))
                yield GaugeMetricFamily(f"tandem:store_tier_{name}", documentation, value)
            for name, documentation in TIER_COUNTERS.items():
                yield CounterMetricFamily(
                    f"tandem:store_tier_{name}", documentation, value=getattr(tier, name)
                )
