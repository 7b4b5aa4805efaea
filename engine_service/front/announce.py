"""The engine announced in the shared tier's registry (`--announce`, tandem_wire/registry.py):
a heartbeat every `--announce-interval-s` writes its address, model, load and store with a
TTL of three intervals, so gateways started with `--discover` find it, and lose it once it
stops (a kill, a partition). A graceful shutdown withdraws it at once.

The Valkey calls block, so they run on a thread of their own, never the event loop. A
registry that does not answer only costs a warning (rate-limited) and a retry at the next
heartbeat: the engine serves on, and gateways that already know it keep it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_service.config import EngineConfig
from engine_service.errors import EngineError
from tandem_wire.registry import (
    Announcement,
    OutageLog,
    Registry,
    RegistryUnavailable,
    ValkeyTarget,
    next_stamp,
)

if TYPE_CHECKING:
    from engine_service.front.core_link import CoreLink
    from engine_service.model.loaded import LoadedModel

log = logging.getLogger("tandem.engine")

TTL_INTERVALS = 3
WITHDRAW_TIMEOUT_S = 3.0  # a shutdown waits no longer for an unreachable registry


def announce_target(config: EngineConfig) -> ValkeyTarget | None:
    """The registry the flags name (its password file read now), None without --announce.

    Raises:
        OSError: the password file cannot be read.
    """
    if not config.announce:
        return None
    return ValkeyTarget.from_flags(config.announce, config.announce_password_file, "--announce")


def start_announcer(
    target: ValkeyTarget | None,
    config: EngineConfig,
    bound: str,
    loaded: LoadedModel,
    core: CoreLink,
) -> Announcer | None:
    """The heartbeat started for the engine listening on `bound` (HOST:PORT), None without
    a registry."""
    if target is None:
        return None
    me = Identity(
        config.announce_address or dialable(bound), loaded.model_id, loaded.name, config.store
    )
    announcer = Announcer(target, me, core, config.announce_interval_s)
    announcer.start()
    return announcer


def dialable(bound: str) -> str:
    """HOST:PORT others can dial for a server bound to `bound`: a wildcard address is no
    one's, so this machine's host name stands for it."""
    host, _, port = bound.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Identity:
    """What does not change between heartbeats."""

    address: str
    model_id: str
    model_name: str
    store: str


class Announcer:
    def __init__(
        self, target: ValkeyTarget, identity: Identity, core: CoreLink, interval_s: float
    ) -> None:
        self.identity = identity
        self.core = core
        self.interval_s = interval_s
        self.ttl_ms = int(TTL_INTERVALS * interval_s * 1000)
        self._registry = Registry(target, timeout_s=min(2.0, max(0.5, interval_s)))
        # One thread: heartbeats never overlap, and the withdrawal comes after the last.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="announce")
        self._outage = OutageLog(log, "the registry")
        self._stamp = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        log.info(
            "announcing %s in %s every %.1fs",
            self.identity.address,
            self._registry.target.describe(),
            self.interval_s,
        )
        self._task = asyncio.get_running_loop().create_task(self._beat())

    async def stop(self) -> None:
        """Stops the heartbeat and withdraws the announcement (waiting at most
        WITHDRAW_TIMEOUT_S: a registry that is down lets it expire instead)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await asyncio.wait_for(
                self._blocking(self._registry.withdraw, self.identity.address), WITHDRAW_TIMEOUT_S
            )
            log.info("announcement of %s withdrawn", self.identity.address)
        except (RegistryUnavailable, TimeoutError) as exc:
            why = str(exc) or f"no answer in {WITHDRAW_TIMEOUT_S:.0f}s"
            log.warning("could not withdraw the announcement (it expires on its own): %s", why)
        self._thread.submit(self._registry.close)  # on its thread, after any call there
        self._thread.shutdown(wait=False)

    async def _beat(self) -> None:
        while True:
            started = time.monotonic()
            self._stamp = next_stamp(self._stamp)
            me = self.identity
            announcement = Announcement(
                me.address, me.model_id, me.model_name, await self._load(), me.store, self._stamp
            )
            try:
                await self._blocking(self._registry.announce, announcement, self.ttl_ms)
            except RegistryUnavailable as exc:
                self._outage.failed(exc, "serving on; retrying every heartbeat")
            else:
                self._outage.succeeded()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def _load(self) -> int:
        """Running + queued, as the Stats RPC reports it; while the core does not answer
        (restarting), the generation streams the front holds."""
        try:
            answer = await asyncio.wait_for(self.core.stats(), self.interval_s)
        except (EngineError, TimeoutError):
            return self.core.pending
        return answer.engine.running + answer.engine.queued

    async def _blocking(self, call: Callable[..., None], *args: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, call, *args)
