"""Many keys at once on a Valkey cluster: grouped by the node that owns their slot, one
pipeline per node, the nodes in parallel.

valkey-py's ClusterPipeline routes keys the same way but cannot send WAIT on the connection
that carried a node's writes, which `replicated` durability needs (WAIT counts the replicas
that caught up with *this connection's* writes). So the grouping is done here, on the
cluster client's own slot map and per-node clients; a MOVED, ASK or lost connection
refreshes that map and the batch is sent once more.
"""

from __future__ import annotations

import logging
import ssl
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import valkey
from valkey.cluster import ClusterNode, ValkeyCluster

from store_service.errors import Unavailable
from store_service.tier.config import TierConfig

log = logging.getLogger(__name__)

T = TypeVar("T")


class TierUnavailable(Unavailable):
    """The cluster did not answer (or not in time): a caller's UNAVAILABLE."""


class NotReplicated(TierUnavailable):
    """The primaries took the writes but no replica confirmed them within the wait."""


_TRANSIENT = (
    valkey.ConnectionError,
    valkey.TimeoutError,
    valkey.exceptions.ClusterDownError,
    valkey.exceptions.MovedError,
    valkey.exceptions.AskError,
    valkey.exceptions.TryAgainError,
    # "cannot be connected", a slot no node covers: not a ValkeyError in valkey-py.
    valkey.exceptions.ValkeyClusterException,
    OSError,
)
_ANY = (valkey.ValkeyError, valkey.exceptions.ValkeyClusterException, OSError)


def _is_redirect(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, valkey.ResponseError) and text.split(" ", 1)[0] in (
        "MOVED",
        "ASK",
        "CLUSTERDOWN",
        "TRYAGAIN",
    )


class ClusterClient:
    """The tier's connection: batched SET/GET/DEL over the cluster's primaries."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        options: dict[str, Any] = {
            "username": config.user or None,
            "password": config.password or None,
            "socket_timeout": config.op_timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
        }
        if config.tls:
            options["ssl"] = True
            options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
            if config.tls_ca is not None:
                options["ssl_ca_certs"] = str(config.tls_ca)
        self._options = options
        self._cluster: ValkeyCluster | None = None
        self._threads = ThreadPoolExecutor(8, thread_name_prefix="tier-io")

    def _connected(self) -> ValkeyCluster:
        if self._cluster is None:
            seeds = [ClusterNode(host, port) for host, port in self.config.seeds]
            try:
                self._cluster = ValkeyCluster(
                    startup_nodes=seeds,
                    require_full_coverage=False,
                    cluster_error_retry_attempts=1,
                    **self._options,
                )
            except _ANY as exc:
                raise TierUnavailable(f"the tier's cluster did not answer: {exc}") from exc
        return self._cluster

    def _refresh(self) -> None:
        cluster = self._cluster
        if cluster is None:
            return
        try:
            cluster.nodes_manager.initialize()
        except _ANY as exc:
            log.warning("refreshing the tier's slot map failed: %s", exc)
            self._cluster = None  # reconnect from the seeds next time
            cluster.close()

    def _by_node(self, keys: Sequence[bytes]) -> dict[str, list[int]]:
        cluster = self._connected()
        groups: dict[str, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            node = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(key))
            if node is None:
                raise TierUnavailable(f"no node serves slot {cluster.keyslot(key)}")
            groups[node.name].append(i)
        return groups

    def _on_nodes(
        self, keys: Sequence[bytes], batch: Callable[[valkey.Valkey, list[int]], T]
    ) -> list[T]:
        """batch(node client, indexes of its keys) on every node owning some keys, in
        parallel; once more after a slot-map refresh if the cluster moved under it."""
        for attempt in (1, 2):
            try:
                cluster = self._connected()
                groups = self._by_node(keys)
                futures = []
                for name, indexes in groups.items():
                    node = cluster.get_node(node_name=name)
                    client = cluster.get_valkey_connection(node)
                    futures.append(self._threads.submit(batch, client, indexes))
                return [f.result() for f in futures]
            except NotReplicated:
                raise  # the writes landed; waiting again would not make a replica faster
            except TierUnavailable:
                if attempt == 2:
                    raise
                self._refresh()
            except _TRANSIENT as exc:
                if attempt == 2:
                    raise TierUnavailable(f"the tier's cluster did not answer: {exc}") from exc
                self._refresh()
            except valkey.ResponseError as exc:
                if not _is_redirect(exc) or attempt == 2:
                    # e.g. OOM under maxmemory with nothing evictable, or an ACL refusal.
                    raise TierUnavailable(f"the tier refused: {exc}") from exc
                self._refresh()
        raise AssertionError("unreachable")

    def set_many(self, items: Sequence[tuple[bytes, bytes]], ttl_s: int, replicas: int = 0) -> None:
        """SET each key (with its TTL); with replicas > 0, also waits until that many
        replicas of every node written hold them.

        Raises:
            TierUnavailable: the cluster did not take them (NotReplicated: no replica
                confirmed in time).
        """
        keys = [k for k, _ in items]
        wait_ms = self.config.replica_wait_ms

        def batch(client: valkey.Valkey, indexes: list[int]) -> None:
            pipe = client.pipeline(transaction=False)
            for i in indexes:
                pipe.set(items[i][0], items[i][1], ex=ttl_s)
            if replicas:
                pipe.execute_command("WAIT", replicas, wait_ms)
            answers = pipe.execute()
            if replicas and int(answers[-1]) < replicas:
                raise NotReplicated(
                    f"{int(answers[-1])} of {replicas} replicas confirmed within {wait_ms} ms"
                )

        self._on_nodes(keys, batch)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of keys, None where absent."""
        found: list[bytes | None] = [None] * len(keys)

        def batch(client: valkey.Valkey, indexes: list[int]) -> None:
            pipe = client.pipeline(transaction=False)
            for i in indexes:
                pipe.get(keys[i])
            for i, value in zip(indexes, pipe.execute(), strict=True):
                found[i] = value

        self._on_nodes(keys, batch)
        return found

    def delete_many(self, keys: Sequence[bytes]) -> None:
        def batch(client: valkey.Valkey, indexes: list[int]) -> None:
            pipe = client.pipeline(transaction=False)
            for i in indexes:
                pipe.delete(keys[i])
            pipe.execute()

        if keys:
            self._on_nodes(keys, batch)

    def ping(self) -> bool:
        try:
            return bool(self._connected().ping(target_nodes=ValkeyCluster.PRIMARIES))
        except (TierUnavailable, *_ANY):
            self._refresh()
            return False

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._cluster is not None:
            self._cluster.close()
