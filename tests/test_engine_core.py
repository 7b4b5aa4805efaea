"""The engine's two processes: the gRPC front and the MLX core it starts and watches.

A core that dies ends the open streams with UNAVAILABLE, health says NOT_SERVING until a
new core is up; SIGTERM drains both; a front that dies takes its core with it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.core.planner import Planner
from engine_service.core.process import CoreService, Outbox, _serve
from engine_service.errors import Overloaded, error_named
from engine_service.loop.limits import Limits
from engine_service.loop.scheduler import Scheduler
from engine_service.model.loading import load_model
from engine_service.protocol.channel import Codec, Delivery, Refused, StatsAnswer
from engine_service.protocol.engine_stats import EngineStats
from engine_service.protocol.events import Event, Finished, Started, Token
from engine_service.protocol.requests import DraftSupport, GenerationRequest
from engine_service.protocol.sampling_options import SamplingOptions
from tandem_client import EngineClient, Generation, TandemError
from tests.servers import ServiceProcess, child_pids, start_engine


def _core_pid(engine: ServiceProcess) -> int:
    children = child_pids(engine.pid)
    assert len(children) == 1, children
    return children[0]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _wait_for(predicate, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_events_and_answers_cross_the_channel_as_they_are() -> None:
    codec = Codec()
    events: list[Event] = [
        Started(5, 2),
        Token(7, -0.5, [(7, -0.5), (9, -1.25)]),
        Finished("stop", stop_token=7),
    ]
    decoded = codec.core_message(codec.encode(Delivery([(3, events)])))
    assert decoded == Delivery([(3, events)])
    stats = EngineStats(running=2, requests_total=9)
    stats.recent.append((1.5, 4))
    answer = codec.core_message(codec.encode(StatsAnswer(1, stats, None)))
    assert isinstance(answer, StatsAnswer)
    assert answer.engine.running == 2 and list(answer.engine.recent) == [(1.5, 4)]
    refused = codec.core_message(codec.encode(Refused(4, "Overloaded", "engine full")))
    assert isinstance(refused, Refused)
    error = error_named(refused.error, refused.message)
    assert isinstance(error, Overloaded) and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_named("NoSuchError", "x").code == grpc.StatusCode.INTERNAL


@pytest.fixture()
def own_engine(tmp_path: Path):  # noqa: ANN201
    proc = start_engine(tmp_path / "engine", "--grace", "20")
    yield proc
    proc.stop()


class HealthWatch:
    """Every status the engine's health Watch stream reports, until stopped."""

    def __init__(self, address: str) -> None:
        self.seen: list[int] = []
        self._channel = grpc.insecure_channel(address)
        stub = health_pb2_grpc.HealthStub(self._channel)
        self._call = stub.Watch(health_pb2.HealthCheckRequest(), timeout=120)
        self._thread = threading.Thread(target=self._read)
        self._thread.start()

    def _read(self) -> None:
        try:
            for reply in self._call:
                self.seen.append(reply.status)
        except grpc.RpcError:
            return  # cancelled by stop()

    def stop(self) -> None:
        self._call.cancel()
        self._thread.join(30)
        self._channel.close()


def test_a_killed_core_ends_open_streams_with_unavailable_and_a_new_one_serves(
    own_engine: ServiceProcess,
) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    watch = HealthWatch(own_engine.address)
    _wait_for(lambda: watch.seen == [serving])
    client = EngineClient(own_engine.address)
    core = _core_pid(own_engine)
    stream = client.stream("Hello", max_tokens=4000, ignore_eos=True)
    next(iter(stream))  # it runs
    os.kill(core, signal.SIGKILL)
    with pytest.raises(TandemError) as lost:
        for _ in stream:
            pass
    assert lost.value.code == grpc.StatusCode.UNAVAILABLE
    assert "engine core exited" in str(lost.value)
    # Health goes NOT_SERVING while the core is gone, then SERVING with a new one.
    _wait_for(lambda: watch.seen[-2:] == [not_serving, serving], timeout=60)
    watch.stop()
    assert _core_pid(own_engine) != core
    again = client.generate("Hello", max_tokens=5, ignore_eos=True)
    assert again.finish_reason == "length" and len(again.token_ids) == 5
    client.close()


def test_sigterm_drains_both_processes(own_engine: ServiceProcess) -> None:
    client = EngineClient(own_engine.address)
    core = _core_pid(own_engine)
    results: list[Generation | Exception] = []

    def run() -> None:
        try:
            results.append(client.generate("Hello", max_tokens=150, ignore_eos=True))
        except Exception as exc:  # noqa: BLE001 - recorded for the assert
            results.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    _wait_for(lambda: client.stats().running == 1)
    assert own_engine.proc is not None
    own_engine.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert len(results) == 1 and isinstance(results[0], Generation), results
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 150
    assert own_engine.proc.wait(30) == 0
    assert _gone(core)
    client.close()


def test_a_killed_front_takes_its_core_along(own_engine: ServiceProcess) -> None:
    core = _core_pid(own_engine)
    own_engine.kill()
    _wait_for(lambda: _gone(core), timeout=30)


def test_warm_up_runs_the_batch_shapes_before_serving(tmp_path: Path) -> None:
    engine = start_engine(
        tmp_path / "engine", "--max-running", "4", env={"TANDEM_ENGINE_WARMUP": "1"}
    )
    try:
        with EngineClient(engine.address) as client:
            result = client.generate("Hello", max_tokens=6, ignore_eos=True)
            assert result.finish_reason == "length" and len(result.token_ids) == 6
            stats = client.stats()  # the warm-up's rows are not requests
            assert stats.requests_total == 1 and stats.generated_tokens_total == 6
    finally:
        engine.stop()
    assert "warmed up [1, 1, 4]" in engine.log_path.read_text()


def test_a_core_whose_engine_loop_died_stops_serving(tmp_path: Path) -> None:
    """An error the engine loop does not catch (here a sink that raises) ends its thread; the
    core's command loop notices and returns None, and the core exits (LOOP_DIED_STATUS), so
    the front ends its streams with UNAVAILABLE instead of leaving them waiting forever."""
    loaded = load_model("", tmp_path)
    scheduler = Scheduler(loaded, Limits(max_running=2))
    scheduler.start()
    context = zmq.Context()
    events = context.socket(zmq.PUSH)
    events.bind("inproc://events")
    commands = context.socket(zmq.PULL)
    commands.bind("inproc://commands")
    parent_read, parent_write = os.pipe()
    try:
        planner = Planner(None, DraftSupport("", 0), scheduler.queued_saves)
        service = CoreService(scheduler, planner, None, Outbox(events, Codec()))

        def broken_sink(events: list[Event]) -> None:
            raise RuntimeError("a bug in delivery")

        request = GenerationRequest("r", [5, 6, 7], 4, SamplingOptions(ignore_eos=True), "")
        scheduler.submit(request, broken_sink)
        assert _serve(service, commands, parent_read, Codec()) is None  # within LOOP_CHECK_MS
        assert not scheduler.running()
    finally:
        os.close(parent_read)
        os.close(parent_write)
        events.close(linger=0)
        commands.close(linger=0)
        context.term()
