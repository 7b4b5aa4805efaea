"""The shared tier as a registry: engines announce themselves in the Valkey cluster with a TTL
heartbeat (engine_service/front/announce.py); gateways discover them there
(gateway_service/discovery.py). docs/engine.md "Announcing", docs/gateway.md "Discovery".

Keys, all in one hash slot (the `{registry}` tag):

    tandem:{registry}:engines           sorted set: address -> its announcement's expiry (ms)
    tandem:{registry}:engine:ADDRESS    the Announcement as JSON, SET with PX = the TTL

Why an index in one slot, not a SCAN of every primary: the tier also holds the checkpoint
records, millions of keys, and every gateway reads the registry every poll interval; a SCAN
would walk them all each time. One slot makes a discovery two commands on one node
(ZRANGEBYSCORE, MGET) and a heartbeat one pipeline; the registry is a few hundred small keys,
so the primary that carries it (and its replica) hardly notices.

Liveness is the key's TTL, kept by the server: an engine that stops announcing is gone when
its key expires, whatever the clocks say. The index's scores are the announcers' wall clocks;
they only let readers skip, and writers prune, entries long past (`SKEW_MARGIN_MS`), so hosts
whose clocks disagree by less than that never hide a live engine.

The URL form and password file are the store's `--tier` ones too (store_service/tier/config.py
parses its URL with `ValkeyTarget`).
valkey-py is imported only when a registry first connects: a server without these flags
never loads it.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

KEY_PREFIX = "tandem:{registry}:"
INDEX = KEY_PREFIX + "engines"
# Index entries older than this (by the announcer's clock) are skipped and pruned.
SKEW_MARGIN_MS = 60_000


# valkey-py's ValkeyCluster: mostly unannotated, its answers typed sync-or-async at once.
Cluster = Any


def engine_key(address: str) -> str:
    return f"{KEY_PREFIX}engine:{address}"


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class RegistryUnavailable(Exception):
    """The registry's cluster did not answer, refused, or not in time."""


@dataclass(frozen=True)
class ValkeyTarget:
    """A Valkey cluster to reach: `valkey://[USER@]HOST:PORT[,HOST:PORT...]` (`valkeys://`
    for TLS), the password read from a file (never a flag: argv is public)."""

    seeds: tuple[tuple[str, int], ...]
    tls: bool = False
    user: str = ""
    password: str = field(default="", repr=False)

    @classmethod
    def parse(cls, url: str, flag: str) -> ValkeyTarget:
        """Raises:
        ValueError: not that form, or a password in the URL (naming `flag`).
        """
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in ("valkey", "valkeys"):
            raise ValueError(f"{flag} wants valkey://[USER@]HOST:PORT[,HOST:PORT...], not {url!r}")
        user, at, hosts = rest.rpartition("@")
        if not at:
            user, hosts = "", rest
        if ":" in user:
            raise ValueError(f"{flag} takes no password in its URL: use {flag}-password-file")
        seeds = []
        for part in hosts.strip("/").split(","):
            host, colon, port = part.rpartition(":")
            if not colon or not host or not port.isdigit():
                raise ValueError(f"{flag}: {part!r} is not HOST:PORT")
            seeds.append((host.strip("[]"), int(port)))
        return cls(seeds=tuple(seeds), tls=scheme == "valkeys", user=user)

    @classmethod
    def from_flags(cls, url: str, password_file: str, flag: str) -> ValkeyTarget:
        """The URL, with the password read from password_file (none when "").

        Raises:
            ValueError: a malformed URL.
            OSError: an unreadable password file.
        """
        target = cls.parse(url, flag)
        if not password_file:
            return target
        try:
            password = Path(password_file).read_text().strip()
        except OSError as exc:
            raise OSError(f"{flag}-password-file {password_file}: {exc.strerror}") from None
        return cls(target.seeds, target.tls, target.user, password)

    def describe(self) -> str:
        """For logs: where and as whom, never the password."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.seeds)
        who = f"{self.user}@" if self.user else ""
        return f"valkey{'s' if self.tls else ''}://{who}{hosts}"


@dataclass(frozen=True)
class Announcement:
    """What an engine says of itself."""

    address: str  # HOST:PORT as clients should dial it
    model_id: str  # name@digest (ModelInfo's model_id)
    model_name: str
    load: int  # running + queued at the heartbeat
    store: str  # the store address it checkpoints to ("" = none)
    updated_ms: int  # wall clock, never lower than the engine's previous announcement's

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Announcement:
        """Unknown fields are ignored (a newer engine's).

        Raises:
            ValueError: not JSON, or a field missing or of the wrong type.
        """
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("an announcement is a JSON object")
        values: dict[str, Any] = {}
        for name, kind in (
            ("address", str),
            ("model_id", str),
            ("model_name", str),
            ("load", int),
            ("store", str),
            ("updated_ms", int),
        ):
            value = raw.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"announcement field {name!r} missing or not {kind.__name__}")
            values[name] = value
        return cls(**values)


def next_stamp(previous_ms: int) -> int:
    """updated_ms for the next announcement: the wall clock, but never back (a clock step)."""
    return max(wall_ms(), previous_ms + 1)


class Registry:
    """Blocking calls on the cluster (run them off an event loop). A failed call drops the
    connection; the next one reconnects from the seeds (the cluster may have moved)."""

    def __init__(self, target: ValkeyTarget, timeout_s: float = 2.0) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._cluster: Cluster | None = None

    def announce(self, announcement: Announcement, ttl_ms: int) -> None:
        """Writes (or refreshes) the announcement for ttl_ms, and prunes long-dead entries."""
        address = announcement.address
        now = wall_ms()

        def write(cluster: Cluster) -> None:
            pipe = cluster.pipeline()
            pipe.zadd(INDEX, {address: now + ttl_ms})
            pipe.set(engine_key(address), announcement.to_json(), px=ttl_ms)
            pipe.zremrangebyscore(INDEX, "-inf", now - SKEW_MARGIN_MS)
            pipe.execute()

        self._run(write)

    def withdraw(self, address: str) -> None:
        """Removes an announcement at once (a graceful shutdown)."""

        def delete(cluster: Cluster) -> None:
            pipe = cluster.pipeline()
            pipe.delete(engine_key(address))
            pipe.zrem(INDEX, address)
            pipe.execute()

        self._run(delete)

    def discover(self) -> list[Announcement]:
        """Every live announcement, by address (a malformed one is skipped)."""

        def read(cluster: Cluster) -> list[bytes | None]:
            members: list[bytes] = cluster.zrangebyscore(INDEX, wall_ms() - SKEW_MARGIN_MS, "+inf")
            if not members:
                return []
            # One slot: a plain MGET, answered by one node.
            keys = [engine_key(m.decode()) for m in sorted(members)]
            values: list[bytes | None] = cluster.mget(keys)
            return values

        found = []
        for value in self._run(read):
            if value is None:
                continue  # expired since the index was read, or a dead engine's entry
            try:
                found.append(Announcement.from_json(value))
            except ValueError as exc:
                log.debug("skipping a malformed announcement: %s", exc)
        return found

    def close(self) -> None:
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.close()

    def _run(self, call: Any) -> Any:
        import valkey

        failures = (valkey.ValkeyError, valkey.exceptions.ValkeyClusterException, OSError)
        try:
            return call(self._connected())
        except failures as exc:
            self.close()  # reconnect from the seeds next time
            raise RegistryUnavailable(f"{self.target.describe()}: {exc}") from exc

    def _connected(self) -> Cluster:
        if self._cluster is None:
            from valkey.cluster import ClusterNode, ValkeyCluster

            options: dict[str, Any] = {
                "username": self.target.user or None,
                "password": self.target.password or None,
                "socket_timeout": self.timeout_s,
                "socket_connect_timeout": self.timeout_s,
            }
            if self.target.tls:
                options.update(ssl=True, ssl_cert_reqs=ssl.CERT_REQUIRED)
            self._cluster = ValkeyCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in self.target.seeds],
                require_full_coverage=False,
                cluster_error_retry_attempts=1,
                **options,
            )
        return self._cluster


class OutageLog:
    """Warnings about a dependency that stopped answering, at most one every `every_s`
    while it stays down, and one line when it answers again."""

    def __init__(self, logger: logging.Logger, what: str, every_s: float = 60.0) -> None:
        self.logger, self.what, self.every_s = logger, what, every_s
        self.failures = 0
        self._warned_at = 0.0

    def failed(self, exc: BaseException, consequence: str) -> None:
        self.failures += 1
        now = time.monotonic()
        if self.failures == 1 or now - self._warned_at >= self.every_s:
            self._warned_at = now
            self.logger.warning(
                "%s did not answer (failure %d): %s; %s",
                self.what,
                self.failures,
                exc,
                consequence,
            )

    def succeeded(self) -> None:
        if self.failures:
            self.logger.info("%s answers again after %d failures", self.what, self.failures)
        self.failures = 0
