"""Prometheus /metrics scraped from real servers during real work: the series exist and their
values add up to what was done."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem_client import EngineClient, StoreClient
from tandem_client.regions import SharedRegion
from tests.conftest import make_checkpoint
from tests.servers import ROOT, InProcessStore, ServiceProcess, free_port, start_engine, start_store

PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _store_and_engine(
    root: Path, engine_data_dir: Path, *extra: str
) -> tuple[InProcessStore, ServiceProcess, int]:
    """A store and an engine on it serving /metrics; returns them and the metrics port."""
    store = InProcessStore(root / "store")
    port = free_port()
    engine = start_engine(
        engine_data_dir,
        "--store",
        store.address,
        "--metrics-listen",
        f"127.0.0.1:{port}",
        *extra,
        log_dir=root,
    )
    return store, engine, port


@pytest.fixture(scope="module")
def engine_with_metrics(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path
) -> Iterator[tuple[ServiceProcess, int]]:
    root = tmp_path_factory.mktemp("metrics")
    store, engine, port = _store_and_engine(root, engine_data_dir)
    try:
        yield engine, port
    finally:
        engine.stop()
        store.stop()


def test_engine_metrics_count_what_was_done(
    engine_with_metrics: tuple[ServiceProcess, int],
) -> None:
    engine, port = engine_with_metrics
    before = scrape(port)
    assert before[("tandem:engine_core_up", ())] == 1
    long_prompt = [(i * 11) % 700 + 30 for i in range(160)]
    generated = []
    with EngineClient(engine.address) as client:
        for prompt in ("Hello metrics", long_prompt, long_prompt + [5]):
            g = client.generate(prompt, max_tokens=6, ignore_eos=True)
            generated.append(len(g.token_ids))
    after = scrape(port)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("tandem:time_to_first_token_seconds_count") == 3
    assert delta("tandem:e2e_request_latency_seconds_count") == 3
    assert delta("tandem:inter_token_latency_seconds_count") == sum(n - 1 for n in generated)
    assert delta("tandem:request_success_total", finished_reason="length") == 3
    assert delta("tandem:request_generation_tokens_sum") == sum(generated)
    assert delta("tandem:generation_tokens_total") == sum(generated)
    assert delta("tandem:prompt_tokens_total") >= 2 + 160
    assert delta("tandem:prefix_cache_queries_total") >= 2
    assert delta("tandem:prefix_cache_hits_total", tier="memory") == 1  # the third request
    assert after[("tandem:num_requests_running", ())] == 0
    assert after[("tandem:store_up", ())] == 1
    assert 0 < delta("tandem:time_to_first_token_seconds_sum") < 60


def test_speculative_counters_match_the_usage(tmp_path: Path, engine_data_dir: Path) -> None:
    store, engine, port = _store_and_engine(
        tmp_path, engine_data_dir, "--draft-model", "tandem-tiny-draft"
    )
    try:
        with EngineClient(engine.address) as client:
            prompts = ([(i * 13 + j) % 900 + 20 for i in range(40)] for j in range(2))
            usages = []
            for prompt in prompts:
                got = client.generate(prompt, max_tokens=24, ignore_eos=True, num_draft_tokens=3)
                assert got.usage is not None
                usages.append(got.usage)
            stats = client.stats()
        samples = scrape(port)
        drafted = sum(u.draft_tokens for u in usages)
        accepted = sum(u.accepted_draft_tokens for u in usages)
        assert samples[("tandem:spec_decode_num_draft_tokens_total", ())] == drafted > 0
        assert samples[("tandem:spec_decode_num_accepted_tokens_total", ())] == accepted
        assert samples[("tandem:spec_decode_num_drafts_total", ())] == (
            stats.speculative_rounds_total
        )
        assert samples[("tandem:spec_decode_num_rollbacks_total", ())] == (
            stats.speculative_rollbacks_total
        )
        assert 0 < stats.speculative_rounds_total < 48
    finally:
        engine.stop()
        store.stop()


def test_engine_rate_histograms_count_store_transfers(
    tmp_path: Path, engine_data_dir: Path
) -> None:
    """With the memory tier off, a prefix hit is a read from the store: one restore and at
    least one checkpoint write land in the GB/s histograms."""
    store, engine, port = _store_and_engine(tmp_path, engine_data_dir, "--prefix-cache-bytes", "0")
    try:
        long_prompt = [(i * 13) % 700 + 30 for i in range(160)]
        with EngineClient(engine.address) as client:
            client.generate(long_prompt, max_tokens=2)
            assert client.flush().durable
            before = scrape(port)
            hit = client.generate(long_prompt + [7], max_tokens=2)
            assert hit.usage is not None and hit.usage.cached_prompt_tokens > 0
        after = scrape(port)
        assert before[("tandem:checkpoint_rate_gb_per_second_count", ())] >= 1
        assert before[("tandem:checkpoint_rate_gb_per_second_sum", ())] > 0
        assert before[("tandem:restore_rate_gb_per_second_count", ())] == 0
        assert after[("tandem:restore_rate_gb_per_second_count", ())] == 1
        assert after[("tandem:prefix_cache_hits_total", (("tier", "store"),))] == 1
        # How the hit's bytes came: the test's store is on this host, so its region.
        assert after[("tandem:store_reads_total", (("route", "region"),))] == 1
        inf = after[("tandem:restore_rate_gb_per_second_bucket", (("le", "+Inf"),))]
        assert inf == 1
    finally:
        engine.stop()
        store.stop()


def test_store_metrics_follow_its_records(tmp_path: Path) -> None:
    port = free_port()
    store = start_store(tmp_path / "store", "--metrics-listen", f"127.0.0.1:{port}")
    try:
        before = scrape(port)
        assert before[("tandem:store_records", ())] == 0
        with StoreClient(store.address) as client:
            client.put(make_checkpoint(b"metrics-key", {"k": 4096}))
            assert client.get(b"metrics-key").key == b"metrics-key"
            with SharedRegion(1 << 20) as region:
                client.register_region(region)
                assert client.get_into(b"metrics-key", region).payload_bytes >= 4096
                client.unregister_region(region)
        after = scrape(port)
        assert after[("tandem:store_records", ())] == 1
        assert after[("tandem:store_payload_bytes", ())] >= 4096
        assert after[("tandem:store_puts_total", ())] - before[("tandem:store_puts_total", ())] == 1
        assert after[("tandem:store_gets_total", ())] >= 1
        assert after[("tandem:store_capacity_bytes", ())] > 0
        # Prometheus 2 asks for OpenMetrics first; the names must reach it with their colons.
        asked = urllib.request.Request(
            f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT}
        )
        with urllib.request.urlopen(asked, timeout=10) as reply:
            text = reply.read().decode()
        assert "\ntandem:store_records " in text and "tandem_store_records" not in text

        def delta(name: str, path: str = "stream") -> float:
            key = (name, (("path", path),))
            return after[key] - before.get(key, 0.0)

        # A small record's payload travels inside its one message (Store.PutRecords).
        assert delta("tandem:store_put_seconds_count", "inline") == 1
        assert delta("tandem:store_put_bytes_sum", "inline") == 4096
        assert delta("tandem:store_get_bytes_count") == 1
        assert 0 < delta("tandem:store_get_seconds_sum") < 30
        region_gets = (("path", "region"),)
        assert after[("tandem:store_get_bytes_count", region_gets)] == 1
        assert after[("tandem:store_get_bytes_sum", region_gets)] >= 4096
    finally:
        store.stop()


def test_the_dashboard_asks_only_for_series_the_servers_export(
    engine_with_metrics: tuple[ServiceProcess, int],
) -> None:
    import json
    import re

    from prometheus_client import CollectorRegistry

    from gateway_service.backends import BackendPool
    from gateway_service.metrics import GatewayMetrics, PoolCollector
    from store_service.metrics import COUNTERS, GAUGES

    dashboard = (ROOT / "docs" / "grafana" / "tandem-dashboard.json").read_text()
    json.loads(dashboard)
    wanted = set(re.findall(r"tandem:[a-z0-9_]+", dashboard))
    exported = {name for name, _ in scrape(engine_with_metrics[1])}
    exported |= {f"tandem:store_{n}" for n in GAUGES} | {
        f"tandem:store_{n}_total" for n in COUNTERS
    }
    registry = CollectorRegistry()
    relay = type("Counts", (), {"requests_total": 0, "failovers_total": 0, "restarts_total": 0})
    GatewayMetrics(registry)
    registry.register(PoolCollector(BackendPool([]), relay))
    exported |= {s.name for family in registry.collect() for s in family.samples}
    exported |= {f.name for f in registry.collect()}  # families without samples yet
    missing = {w for w in wanted if w not in exported and f"{w}_bucket" not in exported}
    assert not missing, missing
