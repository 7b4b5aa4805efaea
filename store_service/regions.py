"""Shared-memory regions: the same-host data plane (docs/store.md, "Shared-memory regions").

The store never opens a region by name: a caller hands it an open file descriptor of memory
it created (region_socket.py), so the store can touch only what the caller could. Three
steps, authentication staying in gRPC:

1. RegisterRegion(name, size) by an authenticated principal: a one-time ticket (random, 10 s,
   never logged), counted against the principal's region quota.
2. The ticket with the fd over the store's Unix socket (SCM_RIGHTS): the fd is checked
   (a regular file, read-write, at least `size` bytes) and kept for the ticket.
3. RegisterRegion(name, size, ticket) by the same principal: the fd becomes its region
   `name` (replacing one of that name), with a lease and a registration id.

A region sealed against shrinking (memfd F_SEAL_SHRINK), on tmpfs and with every page
allocated is mapped and copied into directly: its owner cannot truncate it, so no access
can SIGBUS the store. Any other fd is only ever read and written with pread/pwrite, which
report a truncation as a short read (FAILED_PRECONDITION) instead of a signal.

Registrations carry an id that Gets name: one superseded (registered again, lapsed) can
start no new copy, and every answer says how many copies into superseded ones still run,
so a client knows when the spans of Gets that were cut short are safe to lend again.
"""

from __future__ import annotations

import ctypes
import fcntl
import hmac
import logging
import mmap
import os
import resource
import secrets
import stat
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from store_service import region_prefault
from store_service.errors import InvalidRequest, NotFound, Overloaded, Precondition
from tandem_wire.auth import PermissionDenied

log = logging.getLogger("tandem.store.regions")

DEFAULT_TTL_S = 60
MAX_TTL_S = 3600
TICKET_TTL_S = 10
TICKET_BYTES = 32
MAX_NAME_CHARS = 200
TMPFS_MAGIC = 0x01021994  # memfds live on the kernel's internal tmpfs mount
HOW_TO_REGISTER = (
    "pass the region's file descriptor: RegisterRegion(name, size) answers a ticket, send it "
    "with the fd over the store's region socket, then RegisterRegion(name, size, ticket) "
    "(docs/store.md, 'Shared-memory regions'; tandem_client.SharedRegion does this)"
)


@dataclass(frozen=True)
class RegionLimits:
    per_principal: int = 64  # --max-regions-per-principal: registered and pending
    total: int = 1024  # --max-regions: every principal's, each an fd the store holds

    @classmethod
    def within_fds(cls, per_principal: int, total: int) -> RegionLimits:
        """The total at most half the open-file limit: LMDB, sockets and logs need fds too."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            total = max(1, min(total, soft // 2))
        return cls(per_principal, total)


@dataclass(frozen=True)
class RegionRequest:
    """A RegisterRegion call (wire.py builds it from the message)."""

    name: str
    size: int
    ttl_s: int = 0
    ticket: bytes = b""
    registration: int = 0
    proof: bytes = b""
    data_file: bool = False  # step one: the store's data file back at the handover


@dataclass(frozen=True)
class RegionLease:
    """What RegisterRegion answers: a registration in force, or a ticket to hand over."""

    instance: str
    expires_ms: int = 0
    registration: int = 0
    ticket: bytes = b""
    socket: str = ""
    ticket_expires_ms: int = 0
    superseded_copies: int = 0


@dataclass
class Region:
    name: str
    owner: str
    fd: int  # the caller's, received over the region socket (O_RDWR)
    size: int
    registration: int = 0
    expires_ms: int = 0
    map: mmap.mmap | None = None  # sealed against shrinking: copied into directly
    busy: int = 0  # Gets copying into it now (closed once they are done)
    peer: str = ""  # pid/uid that handed it over (logs)
    data_file: bool = False  # its handover was answered with the data file (direct Gets)

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
        os.close(self.fd)

    def shrank(self) -> bool:
        return os.fstat(self.fd).st_size < self.size

    def fits(self, offset: int, span: int, nbytes: int) -> bool:
        end = min(self.size, offset + span) if span else self.size
        return 0 <= offset and offset + nbytes <= end

    def check_room(self, offset: int, span: int, nbytes: int) -> None:
        if not self.fits(offset, span, nbytes):
            raise Overloaded(
                f"region {self.name!r} holds {self.size} bytes; {nbytes} bytes from offset "
                f"{offset} (span {span or 'to its end'}) do not fit"
            )


@dataclass(frozen=True)
class HandoverAnswer:
    """What the region socket answers a handover: an error ("" = taken), and the store's
    data file when the ticket asked for it and may have it (direct_reads.py)."""

    error: str
    data_file_fd: int = -1
    data_file_refused: str = ""


@dataclass
class _Ticket:
    owner: str
    name: str
    size: int
    expires_ms: int
    region: Region | None = None  # the fd, once handed over
    used: bool = field(default=False)
    data_file: bool = False  # asked for and allowed: the handover answers the data file
    data_file_refused: str = ""  # asked for and not allowed: why


class Regions:
    def __init__(self, copy_threads: int = 4, limits: RegionLimits | None = None) -> None:
        self.copy_threads = copy_threads  # per Get into a region
        self.limits = limits or RegionLimits()
        self.instance = secrets.token_hex(8)  # this process's: a client sees a restart
        self.socket = ""  # where fds are handed over (set when its socket listens)
        self._lock = threading.Lock()
        self._regions: dict[tuple[str, str], Region] = {}
        self._tickets: dict[bytes, _Ticket] = {}
        self._closing: list[Region] = []  # released while a Get was copying into them
        # A read-only fd of the store's data file for direct Gets (None: none are served).
        self.open_data_file: Callable[[], int] | None = None

    def register(
        self, owner: str, request: RegionRequest, now_ms: int, data_file_refused: str = ""
    ) -> RegionLease:
        """Step 1 (a ticket), step 3 (the handed-over fd bound to owner) or a renewal.
        data_file_refused: why this caller may not have the data file ("" = it may)."""
        check_region_name(request.name)
        if request.proof:
            raise Precondition(f"the store opens no region by name: {HOW_TO_REGISTER}")
        if request.size <= 0:
            raise InvalidRequest("size_bytes: the region's size, more than 0")
        if not self.socket:
            raise Precondition("this store takes no regions (--region-socket off)")
        expires = now_ms + min(request.ttl_s or DEFAULT_TTL_S, MAX_TTL_S) * 1000
        key = (owner, request.name)
        with self._lock:
            self._expire(now_ms)
            if request.ticket:
                region = self._redeem(owner, request, now_ms)
                region.registration, region.expires_ms = secrets.randbits(63) or 1, expires
                old = self._regions.pop(key, None)
                self._regions[key] = region
                if old is not None:
                    self._release(old)
                log.info(
                    "region %r of %r registered (%d MiB, %s, by %s)",
                    region.name,
                    owner or "-",
                    region.size >> 20,
                    "mapped" if region.map is not None else "pread/pwrite",
                    region.peer,
                )
                if region.map is not None:
                    region_prefault.start(
                        region.map,
                        region.size,
                        region.name,
                        lambda: self._hold_registered(region),
                        lambda: self.done(region),
                    )
                return self._lease(region)
            held = self._regions.get(key)
            if (
                request.registration
                and held is not None
                and held.registration == request.registration
                and held.size == request.size
            ):
                held.expires_ms = expires
                return self._lease(held)
            self._check_quota(owner, request.name)
            ticket = secrets.token_bytes(TICKET_BYTES)
            ticket_expires = now_ms + TICKET_TTL_S * 1000
            pending = _Ticket(owner, request.name, request.size, ticket_expires)
            if request.data_file:
                if self.open_data_file is None:
                    data_file_refused = data_file_refused or "this store serves no direct reads"
                pending.data_file_refused = data_file_refused
                pending.data_file = not data_file_refused
            self._tickets[ticket] = pending
            return RegionLease(
                self.instance,
                ticket=ticket,
                socket=self.socket,
                ticket_expires_ms=ticket_expires,
                superseded_copies=self._superseded(key),
            )

    def hand_over(self, ticket: bytes, fd: int, peer: str, now_ms: int) -> HandoverAnswer:
        """Step 2 (region_socket.py): keeps fd for the ticket's registration, and answers the
        data file's fd (the socket sends and closes it) when the ticket asked and may have it."""
        error = self._take(ticket, fd, peer, now_ms)
        with self._lock:
            pending = self._find(ticket)
        if error or pending is None or not (pending.data_file or pending.data_file_refused):
            return HandoverAnswer(error)
        if not pending.data_file or self.open_data_file is None:
            return HandoverAnswer("", data_file_refused=pending.data_file_refused)
        try:
            data_fd = self.open_data_file()
        except OSError as exc:
            return HandoverAnswer("", data_file_refused=f"opening the data file: {exc.strerror}")
        if pending.region is not None:
            pending.region.data_file = True
        return HandoverAnswer("", data_file_fd=data_fd)

    def _take(self, ticket: bytes, fd: int, peer: str, now_ms: int) -> str:
        try:
            with self._lock:
                self._expire(now_ms)
                pending = self._find(ticket)
                if pending is None or pending.region is not None:
                    raise Precondition("an unknown, expired or used ticket")
                size = pending.size
            region = Region(pending.name, pending.owner, fd, size, peer=peer)
            region.map = _map_if_sealed(fd, size)
        except (Precondition, OSError) as exc:
            os.close(fd)
            return str(exc)
        with self._lock:
            if self._find(ticket) is not pending or pending.region is not None:
                region.close()
                return "an unknown, expired or used ticket"
            pending.region = region
        return ""

    def unregister(self, owner: str, name: str) -> None:
        check_region_name(name)
        with self._lock:
            region = self._regions.pop((owner, name), None)
            if region is None:
                raise NotFound(f"no region {name!r} registered by this caller")
            self._release(region)

    def get(self, owner: str, name: str, now_ms: int, registration: int = 0) -> Region:
        """A caller's own live region (another caller's name is simply not found), held for
        a copy until done(region). A registration other than the current one is not found
        either: a Get its client has given up on never starts copying."""
        check_region_name(name)
        with self._lock:
            self._expire(now_ms)
            region = self._regions.get((owner, name))
            if region is None or registration not in (0, region.registration):
                raise NotFound(
                    f"no region {name!r} registered by this caller under that registration "
                    "(or its lease lapsed): register it again"
                )
            region.busy += 1
        return region

    def _hold_registered(self, region: Region) -> bool:
        """Holds region as a copy does (until done) if it is still registered."""
        with self._lock:
            if self._regions.get((region.owner, region.name)) is not region:
                return False
            region.busy += 1
        return True

    def done(self, region: Region) -> None:
        with self._lock:
            region.busy -= 1
            if region in self._closing and not region.busy:
                self._closing.remove(region)
                region.close()

    def count(self, now_ms: int) -> int:
        with self._lock:
            self._expire(now_ms)
            return len(self._regions)

    def close(self) -> None:
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
            tickets, self._tickets = list(self._tickets.values()), {}
            for region in regions + [t.region for t in tickets if t.region is not None]:
                self._release(region)

    # -- under the lock ------------------------------------------------------------------------

    def _redeem(self, owner: str, request: RegionRequest, now_ms: int) -> Region:
        pending = self._find(request.ticket)
        if pending is None:
            raise NotFound("no such region ticket (unknown, used or expired): ask for another")
        if pending.owner != owner:
            raise PermissionDenied("this region ticket was issued to another principal")
        if pending.region is None:
            raise Precondition("the ticket's fd was never handed over on the region socket")
        if (pending.name, pending.size) != (request.name, request.size):
            raise InvalidRequest("the ticket was issued for another region name or size")
        del self._tickets[request.ticket]
        return pending.region

    def _find(self, ticket: bytes) -> _Ticket | None:
        for known, pending in self._tickets.items():
            if hmac.compare_digest(known, ticket):
                return pending
        return None

    def _check_quota(self, owner: str, name: str) -> None:
        mine = sum(1 for o, n in self._regions if o == owner and n != name)
        mine += sum(1 for t in self._tickets.values() if t.owner == owner)
        if mine >= self.limits.per_principal:
            raise Overloaded(
                f"this principal has {self.limits.per_principal} regions registered or being "
                "handed over, the most one may have (--max-regions-per-principal)"
            )
        if len(self._regions) + len(self._tickets) >= self.limits.total:
            raise Overloaded(
                f"the store holds {self.limits.total} regions, its most (--max-regions)"
            )

    def _superseded(self, key: tuple[str, str]) -> int:
        return sum(r.busy for r in self._closing if (r.owner, r.name) == key)

    def _lease(self, region: Region) -> RegionLease:
        return RegionLease(
            self.instance,
            expires_ms=region.expires_ms,
            registration=region.registration,
            superseded_copies=self._superseded((region.owner, region.name)),
        )

    def _expire(self, now_ms: int) -> None:
        for key in [k for k, r in self._regions.items() if r.expires_ms <= now_ms]:
            self._release(self._regions.pop(key))
        for ticket in [t for t, p in self._tickets.items() if p.expires_ms <= now_ms]:
            region = self._tickets.pop(ticket).region
            if region is not None:
                region.close()

    def _release(self, region: Region) -> None:
        if region.busy:  # a Get is copying into it: closed when it is done
            self._closing.append(region)
        else:
            region.close()


def check_region_name(name: str) -> None:
    """A region name: printable (no NUL), no slashes, not hidden, at most 200 characters.
    Raises InvalidRequest."""
    if (
        not name
        or "/" in name
        or name.startswith(".")
        or len(name) > MAX_NAME_CHARS
        or not name.isprintable()
    ):
        raise InvalidRequest(
            f"region name: up to {MAX_NAME_CHARS} printable characters, without slashes, "
            "not starting with a dot"
        )


def _map_if_sealed(fd: int, size: int) -> mmap.mmap | None:
    """Checks a handed-over fd (Precondition unless a read-write regular file of at least
    size bytes) and maps it when no caller can make an access fault: sealed against
    shrinking, on tmpfs (no hugetlbfs pool to run dry) and with every page allocated.
    None: accessed with pread/pwrite only."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Precondition("a region is a regular file (a memfd, or a file under /dev/shm)")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise Precondition("the region's fd must be open read-write (O_RDWR)")
    if st.st_size < size:
        raise Precondition(f"the region's file holds {st.st_size} bytes, not {size}")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return None  # a file system without seals
    if not seals & fcntl.F_SEAL_SHRINK or st.st_blocks * 512 < size or not _on_tmpfs(fd):
        return None
    return mmap.mmap(fd, size)


def _on_tmpfs(fd: int) -> bool:
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first word
    if _libc.fstatfs(fd, buf) != 0:
        return False
    return int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], sys.byteorder) == TMPFS_MAGIC


_libc = ctypes.CDLL(None, use_errno=True)
