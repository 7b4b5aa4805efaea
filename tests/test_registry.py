"""The shared tier as a registry, with real processes: a Valkey cluster on loopback, an engine
that announces itself there (`--announce`), and a gateway that knows engines only from it
(`--discover`): discovery, the announcement's content, Valkey down and back, a graceful
withdrawal and an expiry after SIGKILL."""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from store_service.tier.local_cluster import USER, LocalCluster
from tandem_client import EngineClient, TandemError
from tandem_wire.registry import Announcement, Registry, ValkeyTarget
from tests.servers import GatewayProcess, ServiceProcess, run_module, start_engine, wait_until
from tests.tier_stack import password_file, start_cluster

# An announcement lives 3 s without a heartbeat: short for the kill's expiry, long enough
# that an engine starved of CPU on two busy cores does not drop out between heartbeats.
INTERVAL_S = "1"


@dataclass
class Stack:
    root: Path
    cluster: LocalCluster
    engine: ServiceProcess
    gateway: GatewayProcess
    registry: Registry  # the registry as the test reads it


def _url(cluster: LocalCluster) -> str:
    return f"valkey://{USER}@{cluster.seeds}"


def _announce(cluster: LocalCluster) -> list[str]:
    secret = str(password_file(cluster))
    return ["--announce", _url(cluster), "--announce-password-file", secret]


def _gateway(stack_root: Path, cluster: LocalCluster, name: str, *extra: str) -> GatewayProcess:
    secret = str(password_file(cluster))
    args = ["--discover", _url(cluster), "--discover-password-file", secret]
    return GatewayProcess([], stack_root / f"{name}.log", *args, "--poll-interval", "0.1", *extra)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("registry")
    cluster = start_cluster(root / "valkey", primaries=3, replicas=0)
    engine = gateway = None
    target = ValkeyTarget.from_flags(_url(cluster), str(password_file(cluster)), "--test")
    registry = Registry(target)
    try:
        announce = [*_announce(cluster), "--announce-interval-s", INTERVAL_S]
        engine = start_engine(engine_data_dir, *announce, log_dir=root / "engine")
        gateway = _gateway(root, cluster, "gateway")
        yield Stack(root, cluster, engine, gateway, registry)
    finally:
        registry.close()
        if gateway is not None:
            gateway.stop()
        if engine is not None:
            engine.stop()
        cluster.stop()


def _engines(gateway: GatewayProcess) -> dict[str, int]:
    """The gateway's engines, serving and known (/health: 503 while none serves)."""
    try:
        with urllib.request.urlopen(gateway.http + "/health", timeout=5) as reply:
            body = json.load(reply)
    except urllib.error.HTTPError as exc:
        assert exc.code == 503
        body = json.load(exc)
    engines: dict[str, int] = body["engines"]
    return engines


def _announced(stack: Stack) -> dict[str, Announcement]:
    return {a.address: a for a in stack.registry.discover()}


def test_the_gateway_serves_through_the_engine_it_discovered(stack: Stack) -> None:
    stack.gateway.wait_engines(1)
    assert _engines(stack.gateway) == {"serving": 1, "total": 1}
    with EngineClient(stack.engine.address) as direct:
        expected = direct.generate("Hello", max_tokens=6, temperature=0).token_ids
    with EngineClient(stack.gateway.grpc) as through:
        assert through.generate("Hello", max_tokens=6, temperature=0).token_ids == expected


def test_the_announcement_carries_model_and_load(stack: Stack) -> None:
    address = stack.engine.address
    with EngineClient(address) as engine:
        info = engine.model_info()
        first = wait_until(lambda: _announced(stack).get(address), what="the announcement")
        assert (first.model_id, first.model_name, first.store) == (info.model_id, info.name, "")
        # A generation that runs until it is cancelled (the context caps max_tokens) shows in
        # the next heartbeat as load, and leaves it when cancelled.
        request = engine.request(
            "Count", max_tokens=1 << 20, ignore_eos=True, request_id="long-one", temperature=0
        )
        started = threading.Event()
        ended: list[BaseException | None] = []

        def generate() -> None:
            with EngineClient(address) as streaming:
                try:
                    for _ in streaming.stream_request(request):
                        started.set()
                except TandemError as exc:
                    ended.append(None if exc.code == grpc.StatusCode.CANCELLED else exc)
                else:
                    ended.append(None)

        reader = threading.Thread(target=generate)
        reader.start()
        try:
            assert started.wait(30)
            # A heartbeat after `first` (one before it may still count an earlier test's
            # stream, and a slow machine may not have beaten again yet).
            wait_until(
                lambda: (
                    (a := _announced(stack).get(address))
                    and a.updated_ms > first.updated_ms
                    and a.load >= 1
                ),
                what="a heartbeat with the generation's load",
            )
        finally:
            with contextlib.suppress(TandemError):  # NOT_FOUND: it had ended
                engine.cancel("long-one")
            reader.join(30)
        assert ended == [None]
        wait_until(
            lambda: (a := _announced(stack).get(address)) and a.load == 0,
            what="a heartbeat without load",
        )


def test_valkey_down_engines_serve_on_and_a_new_gateway_waits_for_it(stack: Stack) -> None:
    cluster, engine_log = stack.cluster, stack.root / "engine" / "engine.log"
    for node in cluster.nodes:
        cluster.kill(node)
    late = None
    try:
        try:
            wait_until(
                lambda: "did not answer" in engine_log.read_text(), what="the engine's warning"
            )
            with EngineClient(stack.engine.address) as direct:
                assert direct.generate("Still here", max_tokens=3).usage is not None
            # The running gateway keeps the engines it last read from the registry.
            with EngineClient(stack.gateway.grpc) as through:
                assert through.generate("Still routed", max_tokens=3).usage is not None
            # A gateway started now starts, and has no engine to send anything to.
            late = _gateway(stack.root, cluster, "late-gateway", "--failover-wait", "0")
            assert _engines(late) == {"serving": 0, "total": 0}
            with EngineClient(late.grpc) as through, pytest.raises(TandemError) as refused:
                through.generate("Nobody", max_tokens=3)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            for node in cluster.nodes:
                cluster.launch(node)
        cluster.wait_healthy()
        late.wait_engines(1)  # the engine announced itself again; the gateway read it
        with EngineClient(late.grpc) as through:
            assert through.generate("Back", max_tokens=3).usage is not None
        wait_until(lambda: "answers again" in engine_log.read_text(), what="the engine's notice")
    finally:
        if late is not None:
            late.stop()


def test_a_graceful_stop_withdraws_and_a_kill_expires(stack: Stack, engine_data_dir: Path) -> None:
    announce = [*_announce(stack.cluster), "--announce-interval-s", INTERVAL_S]
    second = start_engine(engine_data_dir, *announce, log_dir=stack.root / "second")
    try:
        stack.gateway.wait_engines(2)
        wait_until(lambda: second.address in _announced(stack), what="its announcement")
    finally:
        assert second.terminate() == 0
    log = (stack.root / "second" / "engine.log").read_text()
    assert f"announcement of {second.address} withdrawn" in log
    assert second.address not in _announced(stack)
    wait_until(lambda: _engines(stack.gateway)["total"] == 1, what="the gateway dropping it")

    stack.engine.kill()  # no withdrawal: its announcement expires
    wait_until(lambda: not _announced(stack), timeout=30, what="the announcement expiring")
    wait_until(lambda: _engines(stack.gateway)["total"] == 0, what="the gateway dropping it")


def test_urls_and_password_files(tmp_path: Path) -> None:
    target = ValkeyTarget.parse("valkeys://ops@10.0.0.1:7000,[::1]:7001", "--discover")
    assert target == ValkeyTarget((("10.0.0.1", 7000), ("::1", 7001)), tls=True, user="ops")
    for bad in ("redis://h:1", "valkey://h", "valkey://h:port", "h:1"):
        with pytest.raises(ValueError, match="--discover"):
            ValkeyTarget.parse(bad, "--discover")
    with pytest.raises(ValueError, match="--announce-password-file"):
        ValkeyTarget.parse("valkey://ops:secret@h:1", "--announce")
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    read = ValkeyTarget.from_flags("valkey://ops@h:1", str(secret), "--announce")
    assert read.password == "s3cret"
    assert "s3cret" not in repr(read) + read.describe()
    with pytest.raises(OSError, match="--announce-password-file"):
        ValkeyTarget.from_flags("valkey://ops@h:1", str(tmp_path / "none"), "--announce")


def test_announcements_round_trip_and_malformed_ones_are_refused() -> None:
    sent = Announcement("h:1", "tiny@sha256:00", "tiny", 3, "s:2", 1_700_000_000_000)
    assert Announcement.from_json(sent.to_json()) == sent
    newer = {**json.loads(sent.to_json()), "gpu": "h200"}  # a newer engine's extra field
    assert Announcement.from_json(json.dumps(newer).encode()) == sent
    for bad in (b"[]", b"{", json.dumps({**newer, "load": "3"}).encode()):
        with pytest.raises(ValueError):
            Announcement.from_json(bad)


def test_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from engine_service.config import parse_args as engine_args
    from gateway_service.config import parse_args as gateway_args

    url = "valkey://tandem@127.0.0.1:7000"
    gateway = gateway_args(["--discover", url, "--http-listen", "127.0.0.1:0"])
    assert (gateway.engines, gateway.discover) == ([], url)  # no --engine needed
    engine = engine_args(["--announce", url])
    assert (engine.announce_interval_s, engine.announce_address) == (2.0, "")
    for argv in (
        ["--announce", "redis://h:1"],
        ["--announce", url, "--announce-interval-s", "0"],
        ["--announce", url, "--announce-address", "nowhere"],
    ):
        with pytest.raises(SystemExit):
            engine_args(argv)
    with pytest.raises(SystemExit):
        gateway_args(["--discover", "valkey://h", "--http-listen", "127.0.0.1:0"])
    assert "valkey://[USER@]HOST:PORT" in capsys.readouterr().err


def test_an_unreadable_password_file_stops_either_server_at_once(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    url = "valkey://tandem@127.0.0.1:7000"
    engine = run_module("engine_service", "--announce", url, "--announce-password-file", missing)
    assert engine.returncode == 1 and "--announce-password-file" in engine.stderr
    gateway = run_module(
        "gateway_service",
        *("--discover", url, "--discover-password-file", missing),
        *("--http-listen", "127.0.0.1:0"),
    )
    assert gateway.returncode == 1 and "--discover-password-file" in gateway.stderr
