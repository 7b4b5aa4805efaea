"""The gateway's Prometheus metrics (`--metrics-listen`): time to first token as its callers
see it, failovers, and each engine's health and load as the gateway last read them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway_service.backends import BackendPool
from tandem_wire.metrics import TTFT_BUCKETS


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "tandem:gateway_time_to_first_token_seconds",
            "Arrival at the gateway to the first token sent, failovers included.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.failover_gap = Histogram(
            "tandem:gateway_failover_gap_seconds",
            "A stream's engine lost to the next token from another.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )


class PoolCollector(Collector):
    """Engines and relay counters, read at scrape time."""

    def __init__(self, pool: BackendPool, relay: Any) -> None:
        self.pool = pool
        self.relay = relay

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("tandem:gateway_engine_up", "1 while healthy.", labels=["engine"])
        load = GaugeMetricFamily(
            "tandem:gateway_engine_load", "Running + queued, as routed on.", labels=["engine"]
        )
        streams = GaugeMetricFamily(
            "tandem:gateway_engine_streams", "This gateway's open streams.", labels=["engine"]
        )
        for address, backend in list(self.pool.backends.items()):
            up.add_metric([address], 1 if backend.healthy else 0)
            load.add_metric([address], backend.load)
            streams.add_metric([address], backend.streams)
        yield from (up, load, streams)
        yield CounterMetricFamily(
            "tandem:gateway_requests", "Generations relayed.", value=self.relay.requests_total
        )
        yield CounterMetricFamily(
            "tandem:gateway_failovers",
            "Streams moved to another engine.",
            value=self.relay.failovers_total,
        )
        yield CounterMetricFamily(
            "tandem:gateway_restarts",
            "Failovers that found no checkpoint and generated again.",
            value=self.relay.restarts_total,
        )
