"""Live failover: engines SIGKILLed under 8 concurrent seeded streams (gRPC and SSE) through
the gateway; every stream must end with exactly the tokens of an uninterrupted run.

TANDEM_GATEWAY_KILLS sets the number of kills (`make soak` raises it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest

from tandem_client import EngineClient
from tests.servers import GatewayProcess, InProcessStore, ServiceProcess, free_port, start_engine
from tests.test_metrics import scrape

# One in the suite: tests/test_tier_nodes.py loses a whole node under the same streams.
KILLS = int(os.environ.get("TANDEM_GATEWAY_KILLS", "1"))
SEED = int(os.environ.get("TANDEM_SOAK_SEED", "7"))  # the kill moments (`make soak` varies it)
METRICS_PORT = free_port()
ENGINES = 2  # one killed, the other takes its streams over
STREAMS = 8
CHECKPOINT_INTERVAL = 8  # the gateway's --checkpoint-interval
TOKENS = 64  # 8 checkpoints each
SAMPLING = {"temperature": 0.9, "top_p": 0.95}


@dataclass
class Stream:
    index: int
    grpc: bool  # else SSE through the OpenAI-compatible front
    tokens: list[int] = field(default_factory=list)
    # gRPC: the tokens its logprobs name (asked for each: a failover's replayed ones too)
    logprob_tokens: list[int] = field(default_factory=list)
    text: str = ""
    received: int = 0  # tokens (gRPC) or events (SSE) so far
    failovers: int = -1
    error: str = ""

    @property
    def prompt(self) -> str:
        return f"Story number {self.index} begins:"

    @property
    def seed(self) -> int:
        return 1000 + self.index


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path
) -> Iterator[tuple[GatewayProcess, list[ServiceProcess]]]:
    root = tmp_path_factory.mktemp("failover")
    store = InProcessStore(root / "store")
    engines: list[ServiceProcess] = []
    gateway = None
    try:
        for i in range(ENGINES):
            engines.append(
                start_engine(
                    engine_data_dir,
                    "--store",
                    store.address,
                    # No grace: a drained engine's streams end CANCELLED at once, so none can
                    # finish inside the grace on a fast machine (a 0.3 s grace let all four of
                    # a victim's streams finish once: nothing moved).
                    "--grace",
                    "0",
                    log_dir=root / f"e{i}",
                )
            )
        gateway = GatewayProcess(
            [e.address for e in engines],
            root / "gateway.log",
            "--metrics-listen",
            f"127.0.0.1:{METRICS_PORT}",
            "--checkpoint-interval",
            str(CHECKPOINT_INTERVAL),
            "--poll-interval",
            "0.2",
            "--failover-wait",
            "60",
        )
        gateway.wait_engines(ENGINES)
        yield gateway, engines
    finally:
        if gateway is not None:
            gateway.stop()
        for e in engines:
            e.stop()
        store.stop()


def _run_grpc(address: str | EngineClient, s: Stream, progress: list[int]) -> None:
    """One stream, through a client of its own or one shared with other threads."""
    try:
        with contextlib.ExitStack() as owned:
            client = address
            if isinstance(client, str):
                client = owned.enter_context(EngineClient(client))
            for chunk in client.stream(
                s.prompt, max_tokens=TOKENS, seed=s.seed, ignore_eos=True, logprobs=0, **SAMPLING
            ):
                s.tokens += chunk.token_ids
                s.logprob_tokens += [lp.token_id for lp in chunk.logprobs]
                s.text += chunk.text
                s.received += len(chunk.token_ids)
                progress[0] += len(chunk.token_ids)
                if chunk.usage is not None:
                    s.failovers = chunk.usage.failovers
    except Exception as exc:  # noqa: BLE001 - reported by the test
        s.error = repr(exc)


def _run_sse(http: str, s: Stream, progress: list[int]) -> None:
    body = {
        "model": "tandem-tiny",
        "prompt": s.prompt,
        "max_tokens": TOKENS,
        "seed": s.seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tandem": {"ignore_eos": True},
        **SAMPLING,
    }
    request = urllib.request.Request(
        http + "/v1/completions", data=json.dumps(body).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    s.error = event["error"]["message"]
                    return
                if event["choices"]:
                    s.text += event["choices"][0]["text"]
                    s.received += 1
                    progress[0] += 1
                if event.get("usage"):
                    s.failovers = event["usage"]["failovers"]
    except Exception as exc:  # noqa: BLE001
        s.error = repr(exc)


@pytest.fixture(scope="module")
def expected(
    cluster: tuple[GatewayProcess, list[ServiceProcess]],
) -> dict[int, tuple[list[int], str]]:
    """Each stream's uninterrupted run (tokens, text), straight from an engine."""
    return uninterrupted_runs(cluster[1][0].address)


def uninterrupted_runs(address: str) -> dict[int, tuple[list[int], str]]:
    """Each stream's (tokens, text) when nothing fails, from the engine or gateway there."""
    with EngineClient(address) as client:
        out = {}
        for i in range(STREAMS):
            s = Stream(i, True)
            g = client.generate(
                s.prompt, max_tokens=TOKENS, seed=s.seed, ignore_eos=True, **SAMPLING
            )
            out[i] = (g.token_ids, g.text)
        return out


def stream_problems(
    streams: list[Stream], expected: dict[int, tuple[list[int], str]], label: str = ""
) -> list[str]:
    """The streams that failed or differ from their uninterrupted runs (SSE ones by text)."""
    return [
        f"{label}stream {s.index}: {s.error or 'tokens differ'}"
        for s in streams
        if s.error
        or s.text != expected[s.index][1]
        or (s.grpc and not s.tokens == s.logprob_tokens == expected[s.index][0])
    ]


class GatewayFronts(Protocol):
    grpc: str  # HOST:PORT
    http: str  # http://HOST:PORT


def start_streams(gateway: GatewayFronts, at: int) -> tuple[list[Stream], list[threading.Thread]]:
    """STREAMS streams through the gateway, even ones over gRPC and odd ones over SSE, each
    on its own thread; returns once they have produced `at` tokens together (or after 120 s,
    when the threads' own errors tell what went wrong)."""
    streams = [Stream(i, grpc=i % 2 == 0) for i in range(STREAMS)]
    progress = [0]
    threads = [
        threading.Thread(
            target=_run_grpc if s.grpc else _run_sse,
            args=(gateway.grpc if s.grpc else gateway.http, s, progress),
        )
        for s in streams
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120

    while progress[0] < at and time.monotonic() < deadline:
        time.sleep(0.01)
    return streams, threads


def _busiest(engines: list[ServiceProcess]) -> int:
    running = []
    for e in engines:
        with EngineClient(e.address) as c:
            running.append(c.stats().running)
    return max(range(len(engines)), key=lambda i: running[i])


@dataclass
class Tally:
    rounds: int = 0
    streams: int = 0
    exact: int = 0
    moved: int = 0
    problems: list[str] = field(default_factory=list)


def _round(
    gateway: GatewayProcess,
    engines: list[ServiceProcess],
    expected: dict[int, tuple[list[int], str]],
    at: int,
    stop: Callable[[ServiceProcess], None],
    tally: Tally,
) -> None:
    """8 streams through the gateway; after `at` tokens the busiest engine is stopped by
    `stop`, then started again on its port."""
    streams, threads = start_streams(gateway, at)
    victim = engines[_busiest(engines)]
    port = int(victim.address.rsplit(":", 1)[1])
    stop(victim)
    tally.rounds += 1
    for t in threads:
        t.join(300)
    victim.start_on(port)  # back for the next round
    gateway.wait_engines(len(engines))
    for s in streams:
        tally.streams += 1
        tokens, text = expected[s.index]
        same = s.text == text and (not s.grpc or s.tokens == tokens == s.logprob_tokens)
        tally.exact += same and not s.error
        tally.moved += s.failovers > 0
        if not same or s.error:
            kind = "grpc" if s.grpc else "sse"
            tally.problems.append(f"stream {s.index} ({kind}): {s.error or 'tokens differ'}")


def test_streams_survive_engine_kills_exactly(
    cluster: tuple[GatewayProcess, list[ServiceProcess]],
    expected: dict[int, tuple[list[int], str]],
) -> None:
    gateway, engines = cluster
    rng = random.Random(SEED)
    tally = Tally()
    before = scrape(METRICS_PORT)
    for _ in range(KILLS):
        # Killed at a random point of the round: after 10-70% of its tokens.
        at = rng.randint(STREAMS * TOKENS // 10, STREAMS * TOKENS * 7 // 10)
        _round(gateway, engines, expected, at, ServiceProcess.kill, tally)
    print(
        f"seed {SEED} / kills {tally.rounds} / streams {tally.streams} / exact {tally.exact} "
        f"/ failed over {tally.moved}"
    )
    assert not tally.problems, tally.problems
    assert tally.exact == tally.streams
    assert tally.moved >= tally.rounds  # each kill took at least one stream with it
    after = scrape(METRICS_PORT)

    def delta(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0.0)

    assert delta("tandem:gateway_failovers_total") >= tally.moved
    assert delta("tandem:gateway_requests_total") == tally.streams
    assert delta("tandem:gateway_time_to_first_token_seconds_count") == tally.streams
    assert delta("tandem:gateway_failover_gap_seconds_count") >= tally.moved
    ups = [v for (name, _), v in after.items() if name == "tandem:gateway_engine_up"]
    assert ups == [1.0] * ENGINES


def test_streams_move_off_an_engine_that_drains(
    cluster: tuple[GatewayProcess, list[ServiceProcess]],
    expected: dict[int, tuple[list[int], str]],
) -> None:
    """SIGTERM: the drain (no grace here) ends the engine's streams CANCELLED with their
    checkpoints kept; the gateway resumes them elsewhere, the client never sees it."""
    gateway, engines = cluster
    tally = Tally()
    _round(gateway, engines, expected, STREAMS * TOKENS // 4, _terminate, tally)
    assert not tally.problems, tally.problems
    assert tally.exact == tally.streams and tally.moved >= 1


def _terminate(engine: ServiceProcess) -> None:
    assert engine.terminate(60) == 0
