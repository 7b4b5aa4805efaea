"""Two nodes on one Valkey cluster, each a store (its own LMDB file) and an engine on it,
behind one gateway: a prefix computed on one node is a hit on the other, and a whole node
lost under 8 seeded streams (store and engine SIGKILLed together, its disk gone) loses
none of them: each resumes on the other node from the tier's checkpoints.

TANDEM_NODE_KILLS sets the rounds (`make soak` raises it), TANDEM_SOAK_SEED the moments.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from store_service.tier.local_cluster import LocalCluster
from tandem_client import EngineClient
from tests.servers import GatewayProcess, ServiceProcess, free_port, start_engine, start_store_on
from tests.test_gateway_failover import (
    CHECKPOINT_INTERVAL,
    STREAMS,
    TOKENS,
    Stream,
    start_streams,
    stream_problems,
)
from tests.tier_stack import start_cluster, tier_args

KILLS = int(os.environ.get("TANDEM_NODE_KILLS", "1"))
ATTEMPTS = 3  # a round starts again when the lost node had no stream left (nothing moved)
SEED = int(os.environ.get("TANDEM_SOAK_SEED", "11"))


@dataclass
class Node:
    """A machine's worth of Tandem: a store on a fixed port and an engine on it."""

    root: Path
    cluster: LocalCluster
    engine_data_dir: Path
    store_port: int = 0
    engine_port: int = 0
    store: ServiceProcess | None = None
    engine: ServiceProcess | None = None

    def start(self) -> Node:
        self.store_port = self.store_port or free_port()
        self.store = start_store_on(self.root / "store", self.store_port, *tier_args(self.cluster))
        engine = (
            start_engine(
                self.engine_data_dir,
                "--store",
                f"127.0.0.1:{self.store_port}",
                "--grace",
                "0.3",
                log_dir=self.root,
                timeout=180,
                env={"OPENBLAS_NUM_THREADS": "1"},
            )
            if not self.engine_port
            else self._engine_on_port()
        )
        self.engine = engine
        self.engine_port = int(engine.address.rsplit(":", 1)[1])
        return self

    def _engine_on_port(self) -> ServiceProcess:
        assert self.engine is not None
        return self.engine.start_on(self.engine_port, timeout=180)

    def lose(self) -> None:
        """Power gone: both processes SIGKILLed, and the node comes back with a new disk."""
        assert self.engine is not None and self.store is not None
        self.engine.kill()
        self.store.kill()
        shutil.rmtree(self.root / "store")

    def stop(self) -> None:
        for proc in (self.engine, self.store):
            if proc is not None and proc.proc is not None and proc.proc.poll() is None:
                proc.stop()


@pytest.fixture(scope="module")
def nodes(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path
) -> Iterator[tuple[GatewayProcess, list[Node]]]:
    root = tmp_path_factory.mktemp("nodes")
    cluster = start_cluster(root / "valkey", primaries=3, replicas=0)
    started: list[Node] = []
    gateway = None
    try:
        for name in "ab":
            started.append(Node(root / name, cluster, engine_data_dir).start())
        gateway = GatewayProcess(
            [n.engine.address for n in started if n.engine is not None],
            root / "gateway.log",
            "--checkpoint-interval",
            str(CHECKPOINT_INTERVAL),
            "--poll-interval",
            "0.2",
            "--failover-wait",
            "60",
        )
        gateway.wait_engines(len(started))
        yield gateway, started
    finally:
        if gateway is not None:
            gateway.stop()
        for node in started:
            node.stop()
        cluster.stop()


def _engine(node: Node) -> EngineClient:
    assert node.engine is not None
    return EngineClient(node.engine.address)


def test_a_prefix_computed_on_one_node_is_a_hit_on_the_other(
    nodes: tuple[GatewayProcess, list[Node]],
) -> None:
    a, b = nodes[1]
    prompt = [(i * 389) % 2000 + 3 for i in range(1024)]
    with _engine(a) as engine:
        reference = engine.generate(prompt, max_tokens=4, ignore_eos=True, namespace="x")
        assert engine.flush().durable  # its store's Flush: the write-behind queue drained
    with _engine(b) as engine:
        got = engine.generate(prompt, max_tokens=4, ignore_eos=True, namespace="x")
        stats = engine.stats().checkpoints
    assert got.token_ids == reference.token_ids
    assert got.usage is not None and got.usage.cached_prompt_tokens == len(prompt) - 1
    assert stats.prefix_hits_store == 1
    # From the tier into node B's LMDB, then to its engine through the same-host region.
    assert stats.shared_memory_reads >= 1


def _resumes(node: Node) -> int:
    with _engine(node) as engine:
        return engine.stats().checkpoints.resumes


def test_a_lost_node_loses_no_stream(nodes: tuple[GatewayProcess, list[Node]]) -> None:
    gateway, pair = nodes
    expected = {}
    with _engine(pair[0]) as engine:
        for i in range(STREAMS):
            s = Stream(i, True)
            g = engine.generate(
                s.prompt,
                max_tokens=TOKENS,
                seed=s.seed,
                ignore_eos=True,
                temperature=0.9,
                top_p=0.95,
            )
            expected[i] = (g.token_ids, g.text)
    rng = random.Random(SEED)
    for round_ in range(KILLS):
        # Lost once every stream is past its first checkpoints, at a seeded moment after
        # (and before half the tokens: the Flushes below take a while). When every stream
        # ended during the Flushes, or before the loss, the attempt lost nothing to test:
        # the streams are checked and the round starts again, at the earliest moment.
        for attempt in range(ATTEMPTS):
            at = rng.randint(STREAMS * 20, STREAMS * TOKENS // 2) if not attempt else STREAMS * 20
            if _lose_a_node(gateway, pair, expected, at, f"round {round_}.{attempt} "):
                break
        else:
            raise AssertionError(f"round {round_}: every stream ended before a node was lost")


def _lose_a_node(
    gateway: GatewayProcess,
    pair: list[Node],
    expected: dict[int, tuple[list[int], str]],
    at: int,
    label: str,
) -> bool:
    """Streams through the gateway, a node lost once they have made `at` tokens together;
    every stream exact, and those that moved resumed from the tier. False: no stream was
    running on the node when it was lost (nothing moved)."""
    streams, threads = start_streams(gateway, at)
    # The checkpoints so far in the tier before the loss (a store's Flush drains the
    # write-behind queue): one still queued would be regenerated (exactly), not resumed,
    # and the count of resumes below could not tell that from a failure. A generation is
    # checkpointed at its first token and an engine's Flush covers that checkpoint, so
    # every stream with a token before the Flushes can be resumed; one without (it
    # started late) may be regenerated, exactly. The victim is chosen after the Flushes:
    # the node with the most streams still running then.
    checkpointed = {s.index for s in streams if s.received}
    for node in pair:
        with _engine(node) as engine:
            assert engine.flush().durable
    loads = []
    for node in pair:
        with _engine(node) as engine:
            loads.append(engine.stats().running)
    if not any(loads):
        for t in threads:
            t.join(300)
        problems = stream_problems(streams, expected, label)
        assert not problems, problems
        return False
    victim = pair[max(range(len(pair)), key=lambda i: loads[i])]
    survivor = pair[1 - pair.index(victim)]
    before = _resumes(survivor)
    victim.lose()
    for t in threads:
        t.join(300)
    moved = sum(s.failovers > 0 for s in streams)
    problems = stream_problems(streams, expected, label)
    assert not problems, problems
    # Resumed from the tier's checkpoints (the victim's disk is gone), not regenerated.
    resumable = sum(s.failovers > 0 and s.index in checkpointed for s in streams)
    assert _resumes(survivor) - before >= resumable, (moved, resumable, before)
    victim.start()
    gateway.wait_engines(len(pair))
    return moved > 0
