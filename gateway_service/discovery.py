"""Engines found at run time, beside `--engine` and `--engines-file`: in the shared tier's
registry (`--discover`, tandem_wire/registry.py) and in DNS (`--engines-dns`, the A/AAAA
records of one name, as a Kubernetes headless Service gives).

`BackendPool` reads each source every poll interval. The registry: engines that announced
themselves join, engines whose announcement expired (killed, partitioned) or was withdrawn
(shut down) leave. While the registry does not answer, the engines last read stay (their
health checks still decide what is routed to); a warning says so, rate-limited. A gateway
started while it is down serves no discovered engine until it answers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from tandem_wire.registry import (
    Announcement,
    OutageLog,
    Registry,
    RegistryUnavailable,
    ValkeyTarget,
)

log = logging.getLogger("tandem.gateway")


class EngineSource(Protocol):
    """Engines the pool learns of while it runs."""

    def addresses(self) -> list[str]: ...

    async def refresh(self) -> bool:
        """Reads the source again; True when its engines changed."""
        ...

    def close(self) -> None: ...


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


class DnsEngines:
    """The engines behind DNS names: every A and AAAA record of each `HOST:PORT`, as
    `IP:PORT` (`[IP]:PORT` for IPv6), so every gateway knows an engine by the same address.

    A name that does not resolve keeps the engines it last gave (their health checks still
    decide what is routed to), with a rate-limited warning; a name that never resolved
    gives none until it does. The system resolver (asyncio's getaddrinfo, in a thread)
    follows /etc/resolv.conf as Kubernetes sets it."""

    def __init__(self, names: list[str]) -> None:
        self._names = [dns_name(name) for name in names]
        self._found: dict[tuple[str, int], list[str]] = {}
        self._outage = OutageLog(log, "DNS")

    def addresses(self) -> list[str]:
        return list(dict.fromkeys(a for found in self._found.values() for a in found))

    async def refresh(self) -> bool:
        before = self.addresses()
        loop = asyncio.get_running_loop()
        for host, port in self._names:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:  # socket.gaierror: no such name, resolver down
                kept = f"keeping the {len(self._found.get((host, port), []))} engines of {host}"
                self._outage.failed(exc, kept)
                continue
            self._outage.succeeded()
            self._found[(host, port)] = sorted({_address(str(info[4][0]), port) for info in infos})
        return self.addresses() != before

    def close(self) -> None:
        pass


def dns_name(name: str) -> tuple[str, int]:
    """`HOST:PORT` as its parts; ValueError for anything else."""
    host, sep, port = name.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--engines-dns wants HOST:PORT, got {name!r}")
    return host, int(port)


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
