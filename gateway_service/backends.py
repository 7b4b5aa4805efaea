"""The engines behind the gateway: one channel each, their health and load read every poll
interval, and the choice of engine for a request (least loaded, prefix affinity first).

Health is `grpc.health.v1` Check; load is `Stats` (running + queued) plus the streams this
gateway opened since that reading; `ModelInfo` says what each engine serves and whether it
has a store (a stream checkpoints only there). An engine whose stream failed is marked down
at once and comes back when its health check passes again.

The engines come from `--engine`, the engines file (read again when it changes) and, with
`--discover`, the registry (discovery.py, read every poll interval).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_service.discovery import EngineSource
from tandem_wire.pb import engine_pb2, engine_pb2_grpc

log = logging.getLogger("tandem.gateway")

CALL_TIMEOUT_S = 2.0
# A dead peer is noticed within seconds even when no RST arrives (a host gone, a partition).
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    # A backend made again for an engine back on its address connects afresh, never through
    # the old channel's connection in backoff (gRPC shares them per process by default).
    ("grpc.use_local_subchannel_pool", 1),
]


def channel_options(window_bytes: int) -> list[tuple[str, int]]:
    """A small fixed HTTP/2 window per engine stream (0: gRPC's, grown by BDP probing).

    The gateway reads an engine's stream only as fast as its client takes the relayed
    events; what gRPC reads ahead of that is hidden from the engine, which parks a row only
    once its stream's window is full (docs/engine.md, "Slow readers and turns"). Token
    messages are ~25 bytes, so 16 KiB still holds ~600 of them in flight.
    """
    if not window_bytes:
        return list(CHANNEL_OPTIONS)
    return [
        *CHANNEL_OPTIONS,
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", window_bytes),
    ]


@dataclass(frozen=True)
class EngineFacts:
    """What an engine serves (its ModelInfo)."""

    model_id: str
    name: str
    context_length: int
    has_store: bool
    # Unix time this gateway first read it (OpenAI's `created`: engines do not say when
    # their model was made).
    seen_at: int = 0
    # Started with --deterministic: its generations resume only on engines started so.
    deterministic: bool = False

    def serves(self, model: str) -> bool:
        return not model or model in (self.name, self.model_id)


class Backend:
    def __init__(
        self,
        address: str,
        credentials: grpc.ChannelCredentials | None,
        window_bytes: int = 0,
    ) -> None:
        self.address = address
        options = channel_options(window_bytes)
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self.channel = grpc.aio.secure_channel(address, credentials, options=options)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = False
        self.facts: EngineFacts | None = None
        self.streams = 0  # this gateway's open streams on it
        self.routed = 0  # requests sent to it (equal loads: the one that got fewer)
        self._reported = 0  # running + queued at the last Stats
        self._streams_then = 0  # this gateway's streams at that reading
        self.stats_denied = False
        self.last_problem = ""  # logged once each time it changes

    @property
    def load(self) -> int:
        """Running + queued: the last reading, corrected by the streams opened or closed since
        (another gateway's or a direct client's requests count through the reading)."""
        return max(self.streams, self._reported + self.streams - self._streams_then)

    def report(self, running_and_queued: int) -> None:
        self._reported, self._streams_then = running_and_queued, self.streams

    def serves(self, model: str) -> bool:
        return self.healthy and self.facts is not None and self.facts.serves(model)

    @property
    def has_store(self) -> bool:
        return self.facts is not None and self.facts.has_store

    async def close(self) -> None:
        await self.channel.close()


class BackendPool:
    def __init__(
        self,
        addresses: Iterable[str],
        engines_file: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        token: str = "",
        poll_interval_s: float = 0.5,
        window_bytes: int = 0,
        sources: Iterable[EngineSource] = (),
    ) -> None:
        self._static = list(dict.fromkeys(addresses))
        self._sources = list(sources)  # the registry (--discover), DNS names (--engines-dns)
        self._engines_file = Path(engines_file) if engines_file else None
        self._file_stamp: tuple[float, int] | None = None
        self._credentials = credentials
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.poll_interval_s = poll_interval_s
        self.window_bytes = window_bytes  # each engine stream's HTTP/2 window (channel_options)
        self.backends: dict[str, Backend] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.changed = asyncio.Event()  # set on every health change (failover waits on it)

    async def start(self) -> None:
        for source in self._sources:
            await source.refresh()
        self._sync(self._wanted())
        await asyncio.gather(*(self._poll(b) for b in self.backends.values()))
        for backend in self.backends.values():
            self._tasks[backend.address] = asyncio.create_task(self._watch(backend))
        if self._engines_file is not None:
            self._tasks[""] = asyncio.create_task(self._watch_file())
        if self._sources:
            self._tasks[" discovery"] = asyncio.create_task(self._watch_sources())

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await asyncio.gather(*(b.close() for b in self.backends.values()))
        for source in self._sources:
            source.close()

    def healthy(self, model: str = "") -> list[Backend]:
        return [b for b in self.backends.values() if b.serves(model)]

    def models(self) -> list[EngineFacts]:
        seen: dict[str, EngineFacts] = {}
        for b in self.backends.values():
            if b.healthy and b.facts is not None:
                seen.setdefault(b.facts.name, b.facts)
        return list(seen.values())

    def known_models(self) -> list[EngineFacts]:
        """What every engine ever seen serves, up or down (an unknown model is NOT_FOUND)."""
        return [b.facts for b in self.backends.values() if b.facts is not None]

    def mark_down(self, backend: Backend, why: str) -> None:
        if backend.healthy:
            log.warning("engine %s marked down: %s", backend.address, why)
        backend.healthy = False
        self._notify()

    async def serving(self, backend: Backend) -> bool:
        """Asks the engine now whether it is serving (a drain says NOT_SERVING)."""
        try:
            check = await backend.health.Check(
                health_pb2.HealthCheckRequest(service="tandem.v1.Engine"), timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(check.status == health_pb2.HealthCheckResponse.SERVING)

    async def wait_for_change(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
        except TimeoutError:
            pass

    # -- membership -------------------------------------------------------------------------

    def _wanted(self) -> list[str]:
        wanted = list(self._static)
        if self._engines_file is not None:
            try:
                stat = self._engines_file.stat()
                self._file_stamp = (stat.st_mtime, stat.st_size)
                lines = self._engines_file.read_text().splitlines()
            except OSError as exc:
                log.warning("engines file %s unreadable: %s", self._engines_file, exc)
                return list(self.backends)  # keep what runs
            for line in lines:
                address = line.split("#", 1)[0].strip()
                if address and address not in wanted:
                    wanted.append(address)
        for source in self._sources:
            wanted += [a for a in source.addresses() if a not in wanted]
        return wanted

    def _sync(self, wanted: list[str]) -> None:
        for address in wanted:
            if address not in self.backends:
                self.backends[address] = Backend(address, self._credentials, self.window_bytes)
                if self._tasks:  # started: watch it from now on
                    backend = self.backends[address]
                    self._tasks[address] = asyncio.create_task(self._watch(backend))
                log.info("engine %s added", address)
        for address in [a for a in self.backends if a not in wanted]:
            backend = self.backends.pop(address)
            backend.healthy = False
            task = self._tasks.pop(address, None)
            if task is not None:
                task.cancel()
            # Streams still open on it finish there; the channel closes with the last one.
            asyncio.get_running_loop().call_later(60.0, asyncio.ensure_future, backend.close())
            log.info("engine %s removed", address)
        self._notify()

    async def _watch_file(self) -> None:
        assert self._engines_file is not None
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                stat = self._engines_file.stat()
                stamp: tuple[float, int] | None = (stat.st_mtime, stat.st_size)
            except OSError:
                stamp = None
            if stamp != self._file_stamp:
                self._sync(self._wanted())

    async def _watch_sources(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            changed = [await source.refresh() for source in self._sources]
            if any(changed):
                self._sync(self._wanted())

    # -- health and load --------------------------------------------------------------------

    async def _watch(self, backend: Backend) -> None:
        while True:
            started = time.monotonic()
            await self._poll(backend)
            await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - started)))

    async def _poll(self, backend: Backend) -> None:
        was = backend.healthy
        try:
            check = await backend.health.Check(
                health_pb2.HealthCheckRequest(service="tandem.v1.Engine"),
                timeout=CALL_TIMEOUT_S,
            )
            up = check.status == health_pb2.HealthCheckResponse.SERVING
            if up and backend.facts is None:
                info = await backend.stub.ModelInfo(
                    engine_pb2.ModelInfoRequest(), timeout=CALL_TIMEOUT_S, metadata=self._metadata
                )
                backend.facts = EngineFacts(
                    info.model_id,
                    info.name,
                    info.context_length,
                    info.has_store,
                    int(time.time()),
                    info.deterministic,
                )
            if up:
                await self._read_load(backend)
        except grpc.aio.AioRpcError as exc:
            up = False
            problem = exc.code().name
            if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                problem += " (--engine-token-file needs the generate role on that engine)"
            if problem != backend.last_problem:
                log.warning("engine %s not usable: %s", backend.address, problem)
            backend.last_problem = problem
        else:
            backend.last_problem = ""
        if up and not was and backend.address in self.backends:
            log.info("engine %s serving %s", backend.address, backend.facts)
        backend.healthy = up and backend.address in self.backends
        if backend.healthy != was:
            self._notify()

    async def _read_load(self, backend: Backend) -> None:
        if backend.stats_denied:
            return
        try:
            stats = await backend.stub.Stats(
                engine_pb2.EngineStatsRequest(), timeout=CALL_TIMEOUT_S, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (
                grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.UNAUTHENTICATED,
            ):
                raise
            # Without `admin` on that engine: its load is this gateway's streams alone.
            log.warning(
                "engine %s refuses Stats (%s): load from this gateway's streams only",
                backend.address,
                exc.code().name,
            )
            backend.stats_denied = True
            return
        backend.report(stats.running + stats.queued)

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()
