"""The engine's Prometheus metrics (`--metrics-listen HOST:PORT`), under vLLM's names with a
`tandem:` prefix so existing dashboards fit.

Per request, observed in the front as streams end: time to first token, inter-token latency
(each gap), end-to-end latency, prompt and generation lengths, finish reasons. From the core,
read at scrape time through the same call as the Stats RPC: running and waiting requests,
token counters, prefix-cache queries and hits by tier, restore and checkpoint bytes and
seconds, spill drops and failures, preemptions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from engine_service.protocol.checkpoint_stats import CheckpointStats, RateHistogram
from engine_service.protocol.engine_stats import EngineStats
from tandem_wire.metrics import TTFT_BUCKETS

ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class RequestMetrics:
    """What the front observes of each request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "tandem:time_to_first_token_seconds",
            "Arrival to first token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "tandem:inter_token_latency_seconds",
            "Time between a stream's tokens.",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "tandem:e2e_request_latency_seconds",
            "Arrival to the last message.",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Histogram(
            "tandem:request_prompt_tokens",
            "Prompt tokens a request.",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.generation_tokens = Histogram(
            "tandem:request_generation_tokens",
            "Generated tokens a request.",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.finished = Counter(
            "tandem:request_success",
            "Requests ended, by finish reason.",
            ["finished_reason"],
            registry=registry,
        )

    def finish(self, reason: str, prompt: int, generated: int, ttft: float, e2e: float) -> None:
        self.finished.labels(reason).inc()
        self.prompt_tokens.observe(prompt)
        self.generation_tokens.observe(generated)
        self.e2e.observe(e2e)
        if generated:
            self.ttft.observe(ttft)


ReadStats = Callable[[], "tuple[EngineStats, CheckpointStats | None] | None"]


class CoreCollector(Collector):
    """The core's counters, read when Prometheus scrapes (None: the core is down)."""

    def __init__(self, read: ReadStats) -> None:
        self.read = read

    def collect(self) -> Iterator[Any]:
        answer = self.read()
        yield GaugeMetricFamily(
            "tandem:engine_core_up",
            "1 while the engine core answers.",
            value=0 if answer is None else 1,
        )
        if answer is None:
            return
        e, c = answer
        yield GaugeMetricFamily("tandem:num_requests_running", "Rows decoding.", value=e.running)
        yield GaugeMetricFamily("tandem:num_requests_waiting", "Queued.", value=e.queued)
        yield GaugeMetricFamily(
            "tandem:kv_cache_bytes", "Bytes the running batch's KV caches hold.", e.kv_cache_bytes
        )
        yield _counter("tandem:prompt_tokens", "Prompt tokens admitted.", e.prompt_tokens_total)
        yield _counter("tandem:generation_tokens", "Tokens generated.", e.generated_tokens_total)
        yield _counter(
            "tandem:num_preemptions", "Rows parked for slow readers.", e.parking.preempted_total
        )
        yield _counter(
            "tandem:turns_yielded",
            "Slots given up to waiting requests after --turn-tokens tokens.",
            e.parking.turns_yielded_total,
        )
        yield _counter(
            "tandem:park_captures_failed",
            "Rows asked to leave the batch that kept their slots: capturing them raised.",
            e.parking.capture_failed_total,
        )
        yield _counter("tandem:requests_cancelled", "Requests cancelled.", e.cancelled_total)
        yield _counter(
            "tandem:requests_rejected", "Requests refused at admission.", e.rejected_total
        )
        yield _counter(
            "tandem:rows_failed_alone",
            "Rows the model failed on alone (their batch went on).",
            e.isolated_failures_total,
        )
        yield _counter(
            "tandem:out_of_memory_steps",
            "Batch steps that ran the device out of memory (their rows ran again, fewer at once).",
            e.out_of_memory_steps_total,
        )
        yield GaugeMetricFamily(
            "tandem:row_ceiling",
            "Rows that may run while the device is short of memory (0: --max-running).",
            value=e.row_ceiling,
        )
        spec = e.speculative
        yield _counter("tandem:spec_decode_num_drafts", "Speculative rounds.", spec.rounds_total)
        yield _counter(
            "tandem:spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.drafted_total
        )
        yield _counter(
            "tandem:spec_decode_num_accepted_tokens", "Draft tokens kept.", spec.accepted_total
        )
        yield _counter(
            "tandem:spec_decode_num_rollbacks",
            "Speculative rows that gave rejected proposals back.",
            spec.rollbacks_total,
        )
        if c is None:
            return
        yield _counter(
            "tandem:prefix_cache_queries", "Prefix lookups.", c.local_hits + c.store_hits + c.misses
        )
        hits = CounterMetricFamily(
            "tandem:prefix_cache_hits", "Prefix hits by tier.", labels=["tier"]
        )
        hits.add_metric(["memory"], c.local_hits)
        hits.add_metric(["store"], c.store_hits)
        yield hits
        yield _counter(
            "tandem:restore_failures", "Checkpoints found but not usable.", c.restore_failures
        )
        reads = CounterMetricFamily(
            "tandem:store_reads",
            "Store reads by how their bytes came: the region, or streamed and why.",
            labels=["route"],
        )
        for route, count in sorted(c.reads_by_route.items()):
            reads.add_metric([route], count)
        yield reads
        yield _counter("tandem:restored_bytes", "Bytes restored from the store.", c.restored_bytes)
        yield _counter("tandem:restore_seconds", "Time spent restoring.", c.restore_seconds)
        yield _rate(
            "tandem:restore_rate_gb_per_second",
            "Store reads into caches (prefix hits, resumes), by GB/s.",
            c.restore_rate,
        )
        yield _rate(
            "tandem:checkpoint_rate_gb_per_second",
            "Checkpoint writes to the store, by GB/s.",
            c.checkpoint_rate,
        )
        yield _counter(
            "tandem:checkpoint_saved_bytes", "Checkpoint bytes queued for the store.", c.saved_bytes
        )
        yield _counter("tandem:checkpoints_saved", "Checkpoints queued for the store.", c.saved)
        yield _counter(
            "tandem:checkpoint_capture_seconds",
            "Step-loop time spent capturing and queueing generation checkpoints.",
            c.capture_seconds,
        )
        yield _counter(
            "tandem:spill_dropped", "Checkpoints that did not fit the spill queue.", c.dropped
        )
        yield _counter("tandem:spill_failed", "Checkpoints the store refused or missed.", c.failed)
        yield _counter("tandem:resumes", "Generations resumed from a checkpoint.", c.resumes)
        yield GaugeMetricFamily(
            "tandem:store_up", "1 while the store answers.", value=1 if c.store_up else 0
        )


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _rate(name: str, documentation: str, rates: RateHistogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(
        name, documentation, buckets=rates.cumulative(), sum_value=rates.sum_gbps
    )
