"""Two gateways over three engines that share a store: both send a prefix to the same engine
(rendezvous hashing, found from flags in one and from DNS plus flags in the other), and a
client whose gateway is SIGKILLed mid-stream completes through the other, exactly: the
Python client (gRPC) on its own, the OpenAI SDK with the resume loop docs/gateway.md shows.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import openai
import pytest

from gateway_service.affinity import affinity_key, rendezvous_rank
from tandem_client import EngineClient
from tandem_client.engine_client import generate_request
from tests.servers import GatewayProcess, InProcessStore, ServiceProcess, start_engine
from tests.test_gateway_failover import (
    SAMPLING,
    STREAMS,
    TOKENS,
    Stream,
    _run_grpc,
    stream_problems,
    uninterrupted_runs,
)

SEED = 11  # the kill moment


@dataclass
class Fleet:
    engines: list[ServiceProcess]
    gateways: list[GatewayProcess]
    second_log: Path  # the gateway that survives


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("pair")
    store = InProcessStore(root / "store")
    engines: list[ServiceProcess] = []
    gateways: list[GatewayProcess] = []
    settings = ["--checkpoint-interval", "8", "--poll-interval", "0.2", "--failover-wait", "60"]
    try:
        for i in range(3):
            engines.append(
                start_engine(
                    engine_data_dir,
                    "--store",
                    store.address,
                    "--grace",
                    "0.3",
                    log_dir=root / f"e{i}",
                )
            )
        addresses = [e.address for e in engines]
        gateways.append(GatewayProcess(addresses, root / "gateway-a.log", *settings))
        # The other finds the first engine in DNS (`localhost` resolves to 127.0.0.1, where
        # it listens) and is given the others in another order: the same engines.
        port = addresses[0].rsplit(":", 1)[1]
        gateways.append(
            GatewayProcess(
                addresses[:0:-1],
                root / "gateway-b.log",
                "--engines-dns",
                f"localhost:{port}",
                *settings,
            )
        )
        for gateway in gateways:
            gateway.wait_engines(3)
        yield Fleet(engines, gateways, root / "gateway-b.log")
    finally:
        for gateway in gateways:
            gateway.stop()
        for e in engines:
            e.stop()
        store.stop()


def _request_counts(engines: list[ServiceProcess]) -> list[int]:
    counts = []
    for e in engines:
        with EngineClient(e.address) as c:
            counts.append(c.stats().requests_total)
    return counts


def _grew(before: list[int], after: list[int]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b > a]


def test_both_gateways_send_a_prefix_to_its_rendezvous_engine(fleet: Fleet) -> None:
    addresses = [e.address for e in fleet.engines]
    for n in range(6):
        prefix = [(n * 131 + i * 37) % 900 + 20 for i in range(80)]
        chosen = []
        for gateway, tail in zip(fleet.gateways, ([5, 6], [7, 8, 9]), strict=True):
            before = _request_counts(fleet.engines)
            with EngineClient(gateway.grpc) as client:
                client.generate(prefix + tail, max_tokens=2)
            chosen.append(_grew(before, _request_counts(fleet.engines)))
        key = affinity_key(generate_request(prefix + [5, 6]), "")  # "": a caller without auth
        top = rendezvous_rank(key, addresses)[0]
        # Idle engines: no load slack at play, each gateway takes the ranking's first.
        assert chosen == [[addresses.index(top)], [addresses.index(top)]], n


def _run_openai(bases: list[str], s: Stream, progress: list[int]) -> None:
    """docs/gateway.md's resume loop: a stream whose gateway dies goes on through the next
    one with the request id and the tokens held that each chunk reports."""
    request_id, held, resume = f"pair-{s.index}", 0, False
    deadline = time.monotonic() + 120
    at = 0
    while time.monotonic() < deadline:
        client = openai.OpenAI(base_url=bases[at] + "/v1", api_key="unused", max_retries=0)
        tandem = {"ignore_eos": True, "request_id": request_id, "resume": resume}
        try:
            stream = client.completions.create(
                model="tandem-tiny",
                prompt=s.prompt,
                max_tokens=TOKENS,
                seed=s.seed,
                stream=True,
                extra_body={"tandem": {**tandem, "tokens_held": held}},
                temperature=SAMPLING["temperature"],
                top_p=SAMPLING["top_p"],
            )
            for chunk in stream:
                if chunk.choices:
                    s.text += chunk.choices[0].text
                    progress[0] += 1
                held = (chunk.model_extra or {}).get("tandem", {}).get("tokens_held", held)
            return
        except (openai.APIConnectionError, httpx2.TransportError):
            at, resume = (at + 1) % len(bases), held > 0  # the gateway is gone: the next one
        except openai.ConflictError:
            time.sleep(0.2)  # the engine still ends the dead gateway's row
        except openai.NotFoundError:
            resume = False  # no checkpoint yet: again from the start, `held` skipped
        finally:
            client.close()
    s.error = "no gateway finished the stream in 120 s"


def test_a_killed_gateway_s_streams_complete_through_the_other(fleet: Fleet) -> None:
    expected = uninterrupted_runs(fleet.engines[0].address)
    first, second = fleet.gateways
    relayed_before = fleet.second_log.read_text().count("request_id=")
    streams = [Stream(i, grpc=i % 2 == 0) for i in range(STREAMS)]
    progress = [0]
    # One EngineClient for the 4 gRPC streams, as threads of a service share one: each
    # moves on by itself, without closing the others' calls.
    shared = EngineClient(f"{first.grpc},{second.grpc}")
    threads = [
        threading.Thread(
            target=_run_grpc if s.grpc else _run_openai,
            args=(shared if s.grpc else [first.http, second.http], s, progress),
        )
        for s in streams
    ]
    for t in threads:
        t.start()
    # SIGKILL at a random point: after 10-70% of the tokens.
    at = random.Random(SEED).randint(STREAMS * TOKENS // 10, STREAMS * TOKENS * 7 // 10)
    deadline = time.monotonic() + 120
    while progress[0] < at and time.monotonic() < deadline:
        time.sleep(0.01)
    assert progress[0] < STREAMS * TOKENS  # streams in flight: each began on this gateway
    first.proc.kill()
    first.proc.wait(30)
    for t in threads:
        t.join(300)
    shared.close()
    assert not stream_problems(streams, expected), stream_problems(streams, expected)
    assert all(not t.is_alive() for t in threads)
    moved = fleet.second_log.read_text().count("request_id=") - relayed_before
    assert moved >= 1  # what was left of them went on through the other gateway
