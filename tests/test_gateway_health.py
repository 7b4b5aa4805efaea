"""The gateway's own health follows its engines, and its request log says how each request
ended: a gateway over one engine, the engine killed and started again on its port."""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.servers import GatewayProcess, ServiceProcess, free_port, wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NAME = "tandem.v1.Engine"  # what both the engine and the gateway serve


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path
) -> Iterator[tuple[GatewayProcess, ServiceProcess, Path]]:
    root = tmp_path_factory.mktemp("gateway-health")
    engine = ServiceProcess(
        "engine_service",
        ["--data-dir", str(engine_data_dir)],
        "tandem-engine listening on",
        root / "engine.log",
    )
    engine.start_on(free_port(), timeout=180)
    log = root / "gateway.log"
    gateway = GatewayProcess(
        [engine.address], log, "--poll-interval", "0.2", "--log-format", "json"
    )
    try:
        gateway.wait_engines(1)
        yield gateway, engine, log
    finally:
        gateway.stop()
        engine.stop()


def _request_lines(log: Path) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("logger") == "tandem.gateway.requests"]


def test_http_requests_are_logged_with_their_finish_and_namespace(
    pair: tuple[GatewayProcess, ServiceProcess, Path],
) -> None:
    gateway, _, log = pair
    sdk = openai.OpenAI(base_url=gateway.http + "/v1", api_key="none", max_retries=0)
    whole = sdk.completions.create(model="tandem-tiny", prompt="Hello", max_tokens=5)
    assert whole.choices[0].finish_reason == "length"
    streamed = sdk.completions.create(
        model="tandem-tiny", prompt="Hello", max_tokens=5, stream=True
    )
    assert [c.choices[0].finish_reason for c in streamed][-1] == "length"
    lines = wait_until(lambda: len(_request_lines(log)) >= 2 and _request_lines(log), 30)
    assert [(line["finish"], line["namespace"]) for line in lines[-2:]] == [
        ("FINISH_REASON_LENGTH", "default"),
        ("FINISH_REASON_LENGTH", "default"),
    ]
    # OpenAI's `created`: when this gateway first saw the model (a Unix time, not 0).
    (model,) = sdk.models.list().data
    sdk.close()
    assert 1_700_000_000 < model.created <= time.time()


def test_grpc_health_follows_the_engines(
    pair: tuple[GatewayProcess, ServiceProcess, Path],
) -> None:
    gateway, engine, _ = pair
    port = int(engine.address.rsplit(":", 1)[1])
    seen: queue.Queue[int] = queue.Queue()
    with grpc.insecure_channel(gateway.grpc) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="tandem.v1.Engine"))

        def read() -> None:
            try:
                for reply in watch:
                    seen.put(reply.status)
            except grpc.RpcError:
                seen.put(-1)  # the watch ended

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert seen.get(timeout=30) == SERVING
        engine.kill()  # the gateway's only engine
        assert seen.get(timeout=30) == NOT_SERVING
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == NOT_SERVING
        with pytest.raises(urllib.error.HTTPError) as unhealthy:
            urllib.request.urlopen(gateway.http + "/health", timeout=10)
        assert unhealthy.value.code == 503
        unhealthy.value.close()
        engine.start_on(port, timeout=180)  # back on its address
        assert seen.get(timeout=60) == SERVING
        watch.cancel()


def test_a_watch_open_at_shutdown_ends_cleanly(
    pair: tuple[GatewayProcess, ServiceProcess, Path],
) -> None:
    gateway, _, log = pair
    _watch_through_a_stop(gateway.grpc, gateway.stop)
    logged = log.read_text()
    assert "Traceback" not in logged and '"level": "error"' not in logged


def test_an_engine_s_watch_open_at_shutdown_ends_cleanly(
    pair: tuple[GatewayProcess, ServiceProcess, Path],
) -> None:
    _, engine, _ = pair
    _watch_through_a_stop(engine.address, lambda: engine.terminate(60))
    logged = engine.log_path.read_text()
    assert "Traceback" not in logged and " ERROR " not in logged


def _watch_through_a_stop(address: str, stop: Callable[[], int]) -> None:
    """Watches of both services stay open while `stop` stops the server gracefully: each
    sees NOT_SERVING last, then ends OK."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watches = [stub.Watch(health_pb2.HealthCheckRequest(service=s)) for s in ("", NAME)]
        for watch in watches:
            assert next(watch).status == SERVING
        assert stop() == 0
        for watch in watches:
            assert [reply.status for reply in watch] == [NOT_SERVING]
            assert watch.code() == grpc.StatusCode.OK
