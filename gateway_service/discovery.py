"""Engines found in the shared tier's registry (`--discover`, tandem_wire/registry.py), a
third source of the pool's engines beside `--engine` and `--engines-file`.

`BackendPool` reads it every poll interval: engines that announced themselves join, engines
whose announcement expired (killed, partitioned) or was withdrawn (shut down) leave. While the
registry does not answer, the engines last read stay (their health checks still decide what
is routed to); a warning says so, rate-limited. A gateway started while it is down serves no
discovered engine until it answers.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from tandem_wire.registry import (
    Announcement,
    OutageLog,
    Registry,
    RegistryUnavailable,
    ValkeyTarget,
)

log = logging.getLogger("tandem.gateway")


class Discovery:
    def __init__(self, target: ValkeyTarget) -> None:
        self._registry = Registry(target)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="discovery")  # off the loop
        self._outage = OutageLog(log, "the registry")
        self.engines: dict[str, Announcement] = {}  # by address, as last read

    def addresses(self) -> list[str]:
        return list(self.engines)

    async def refresh(self) -> bool:
        """Reads the registry; True when the set of engines changed."""
        loop = asyncio.get_running_loop()
        try:
            found = await loop.run_in_executor(self._thread, self._registry.discover)
        except RegistryUnavailable as exc:
            kept = f"keeping the {len(self.engines)} engines it listed"
            self._outage.failed(exc, kept)
            return False
        self._outage.succeeded()
        before = set(self.engines)
        self.engines = {a.address: a for a in found}
        return set(self.engines) != before

    def close(self) -> None:
        # On its thread, after a read still running there.
        self._thread.submit(self._registry.close)
        self._thread.shutdown(wait=False)
