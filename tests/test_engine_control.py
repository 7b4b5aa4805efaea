"""Cancellation, disconnects, deadlines, admission limits, bad input, shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem_client import EngineClient, Generation, GenerationChunk, TandemError
from tests.servers import ServiceProcess, start_engine

LONG = dict(max_tokens=4000, ignore_eos=True)


def _wait_for(predicate, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _draining(address: str) -> bool:
    """The engine has stopped admitting: its health says NOT_SERVING (set right after it
    stops accepting work), or it no longer answers at all."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.RpcError:
            return True
    return bool(reply.status == health_pb2.HealthCheckResponse.NOT_SERVING)


def _idle(client: EngineClient) -> bool:
    s = client.stats()
    return s.running == 0 and s.queued == 0


def test_cancel_stops_the_generation_and_frees_the_row(engine_client: EngineClient) -> None:
    _wait_for(lambda: _idle(engine_client))
    before = engine_client.stats().cancelled_total
    chunks: list[GenerationChunk] = []

    def consume() -> None:
        chunks.extend(engine_client.stream("Hello", request_id="to-cancel", **LONG))

    thread = threading.Thread(target=consume)
    thread.start()
    _wait_for(lambda: engine_client.stats().running == 1)
    engine_client.cancel("to-cancel")
    thread.join(30)
    assert chunks[-1].finish_reason == "cancelled"
    assert len(chunks) < 4000
    _wait_for(lambda: _idle(engine_client))
    assert engine_client.stats().cancelled_total == before + 1
    with pytest.raises(TandemError) as failure:
        engine_client.cancel("to-cancel")
    assert failure.value.code == grpc.StatusCode.NOT_FOUND


def test_client_disconnect_frees_the_row(engine_client: EngineClient) -> None:
    _wait_for(lambda: _idle(engine_client))
    before = engine_client.stats().cancelled_total
    stream = engine_client.stream("Hello", **LONG)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()  # cancels the call
    _wait_for(lambda: _idle(engine_client))
    assert engine_client.stats().cancelled_total == before + 1


def test_deadline_is_honoured(engine_client: EngineClient) -> None:
    _wait_for(lambda: _idle(engine_client))
    request = engine_client.request("Hello", **LONG)
    with pytest.raises(TandemError) as failure:
        list(engine_client.stream_request(request, timeout=0.5))
    assert failure.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for(lambda: _idle(engine_client))


def test_duplicate_request_id_is_already_exists(engine_client: EngineClient) -> None:
    stream = engine_client.stream("Hello", request_id="dup", **LONG)
    next(stream)
    with pytest.raises(TandemError) as failure:
        engine_client.generate("Hello", request_id="dup", max_tokens=2)
    assert failure.value.code == grpc.StatusCode.ALREADY_EXISTS
    stream.close()
    _wait_for(lambda: _idle(engine_client))


@pytest.mark.parametrize(
    "request_kwargs,needle",
    [
        (dict(prompt=""), "empty"),
        (dict(prompt="hi", max_tokens=0), "max_tokens"),
        (dict(prompt="hi", max_tokens=-3), "max_tokens"),
        (dict(prompt="hi", temperature=-0.5), "temperature"),
        (dict(prompt="hi", top_p=0.0), "top_p"),
        (dict(prompt="hi", top_p=1.5), "top_p"),
        (dict(prompt="hi", top_k=-1), "top_k"),
        (dict(prompt="hi", min_p=1.0), "min_p"),
        (dict(prompt="hi", logprobs=50), "logprobs"),
        (dict(prompt=[1, 2, 99999]), "unknown token"),
        (dict(prompt=[1, -4]), "unknown token"),
        (dict(prompt="hi", stop_token_ids=[70000]), "unknown token"),
        (dict(prompt="hi", stop=[""]), "stop"),
    ],
)
def test_bad_input_is_invalid_argument_and_the_engine_keeps_serving(
    engine_client: EngineClient, request_kwargs: dict[str, Any], needle: str
) -> None:
    prompt = request_kwargs.pop("prompt")
    with pytest.raises(TandemError) as failure:
        engine_client.generate(prompt, **request_kwargs)
    assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in str(failure.value)
    assert engine_client.generate("hi", max_tokens=2, ignore_eos=True).token_ids


def test_prompt_longer_than_the_context_is_invalid_argument(engine_client: EngineClient) -> None:
    with pytest.raises(TandemError) as failure:
        engine_client.generate([5] * 8192, max_tokens=4)
    assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "context" in str(failure.value)
    # Long prompts are served: 2,560 tokens, two prefill chunks (of 2,048).
    got = engine_client.generate([5, 6, 7, 8] * 640, max_tokens=3, ignore_eos=True)
    assert got.usage is not None and got.usage.prompt_tokens == 2560
    assert len(got.token_ids) == 3


def test_tokenize_detokenize_and_bad_ids(engine_client: EngineClient) -> None:
    ids = engine_client.tokenize("déjà vu 🙂")
    assert engine_client.detokenize(ids) == "déjà vu 🙂"
    with pytest.raises(TandemError) as failure:
        engine_client.detokenize([3, 100000])
    assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_health_and_reflection(engine: ServiceProcess) -> None:
    with grpc.insecure_channel(engine.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Engine"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        (listed,) = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for s in listed.list_services_response.service}
        assert "tandem.v1.Engine" in names


@pytest.fixture
def small_engine(engine_data_dir: Path, tmp_path: Path) -> Iterator[ServiceProcess]:
    proc = start_engine(
        engine_data_dir,
        "--max-running",
        "2",
        "--max-queued",
        "1",
        "--grace",
        "20",
        log_dir=tmp_path,
    )
    yield proc
    proc.stop()


def test_admission_limits_and_graceful_shutdown(small_engine: ServiceProcess) -> None:
    client = EngineClient(small_engine.address)
    results: dict[int, Generation | Exception] = {}

    def run(i: int, max_tokens: int) -> None:
        try:
            results[i] = client.generate(
                "Hello", max_tokens=max_tokens, ignore_eos=True, request_id=f"r{i}"
            )
        except Exception as exc:  # noqa: BLE001 - recorded for the asserts
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, 300)) for i in range(3)]
    for t in threads:
        t.start()
    _wait_for(lambda: client.stats().running == 2 and client.stats().queued == 1)
    with pytest.raises(TandemError) as failure:
        client.generate("Hello", max_tokens=2)
    assert failure.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-running 2" in str(failure.value)

    # SIGTERM: in-flight work finishes within the grace period; new work is refused.
    assert small_engine.proc is not None
    small_engine.proc.send_signal(15)
    _wait_for(lambda: _draining(small_engine.address))
    with pytest.raises(TandemError) as refused:
        client.generate("Hello", max_tokens=2)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    for t in threads:
        t.join(60)
    assert all(
        isinstance(r := results[i], Generation) and r.finish_reason == "length" for i in range(3)
    ), results
    assert small_engine.proc.wait(30) == 0
    client.close()
