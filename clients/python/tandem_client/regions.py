"""A shared-memory region for the store's same-host data plane (docs/store.md).

`SharedRegion(size)` creates the region as a memfd (anonymous memory with a file
descriptor), reserves every page and seals it against shrinking and growing, so the store
can map it without any risk of a SIGBUS. `StoreClient.register_region(region)` hands the
fd itself to the store (over its Unix region socket, with a one-time ticket from gRPC): the
store touches only memory this process could, never a file by name. Then
`get_into(key, region)` has the store copy a record's payload straight into it: the tensors
come back as views of the region, checked chunk by chunk by the store as it copied. Linux
only (memfd_create).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import secrets
import socket
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from tandem_client.errors import DataLoss, FailedPrecondition, TandemError
from tandem_wire import pages
from tandem_wire.pb import store_pb2

log = logging.getLogger(__name__)

# Where each region's name is published, as a symlink to its fd (/proc/PID/fd/N): for `ls`,
# for tools that watch one (tests/test_restore_faults.py), and to spot a dead process's.
# Opening the link needs the rights to the process's fds: it grants nothing.
SHM_DIR = Path("/dev/shm")
# Statuses a region Get ends with only once the store's copy threads are done (or before
# they started): its span may be lent again at once.
SETTLED_CODES = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.UNIMPLEMENTED,  # a store without the method: nothing started
    }
)
# Where get_into puts a payload by default: the whole region is the caller's.
DEFAULT_OFFSET = 0
PAGE = 4096


class SharedRegion:
    """Memory this process shares with the store: `buf` (a memoryview of `size` bytes) and
    `fd`, which register_region hands over.

    Args:
        size: bytes.
        name: the name the store knows it by (default: tandem-PID-RANDOM).
        fd: wrap this open read-write file instead of creating a sealed memfd (the store
            then reads and writes it with pread/pwrite only, unless it is sealed against
            shrinking); the region takes the fd over.
    """

    def __init__(self, size: int, name: str = "", fd: int | None = None) -> None:
        if size < PAGE:
            raise ValueError(f"a region needs at least {PAGE} bytes")
        self.name = name or f"tandem-{os.getpid()}-{secrets.token_hex(8)}"
        self.size = size
        self.registration = 0  # what the store answered for it (same_host.py)
        self.store_instance = ""
        own_memfd = fd is None
        if fd is None:
            fd = _sealed_memfd(self.name, size)
        try:
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.buf = memoryview(self._map)
        self._link = SHM_DIR / self.name
        with contextlib.suppress(OSError):  # a name tag only: nothing depends on it
            os.symlink(f"/proc/{os.getpid()}/fd/{fd}", self._link)
        # Its pages mapped now, off the caller's thread: the first read of each (a restore
        # landing from it) faulted otherwise (tandem_wire/pages.py). Only our own memfd's: a
        # caller's file may live on a disk, whose pages a populate would read and dirty.
        if own_memfd:
            threading.Thread(target=self._populate, name="region-prefault", daemon=True).start()

    def _populate(self) -> None:
        """Holds a view of the mapping while it runs: a close meanwhile leaves the mapping to
        go with the last view, as with a checkpoint's tensors."""
        try:
            view = (ctypes.c_char * self.size).from_buffer(self._map)
        except (BufferError, ValueError, TypeError):
            return  # closed already
        try:
            # Stops once closed; a kernel that refuses leaves pages to fault in as used.
            pages.populate_in_steps(ctypes.addressof(view), self.size, self._open, _nothing)
        finally:
            del view

    def _open(self) -> bool:
        return self.fd >= 0

    def close(self) -> None:
        """Lets the region go; it is unmapped now, or when the last view of it goes (a
        checkpoint's tensors may still point into it). The store keeps the memory until it
        lets go of its own fd (unregistered, or the lease lapsed)."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            self._link.unlink()
        os.close(self.fd)
        self.fd = -1
        try:
            self.buf.release()
            self._map.close()
        except BufferError:
            pass  # views remain: the mapping goes with them

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nothing() -> None:
    pass


def _sealed_memfd(name: str, size: int) -> int:
    if not hasattr(os, "memfd_create"):
        raise OSError("same-host regions need Linux (memfd_create)")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        # Every page reserved now: no memory fails here (OSError), never as a fault later.
        os.posix_fallocate(fd, 0, size)
        # Neither this process nor any other can shrink it now: the store maps it safely.
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def hand_over(address: str, ticket: bytes, fd: int, timeout: float = 10.0) -> int | None:
    """Sends a region's fd with its ticket over the store's region socket (RegisterRegion's
    answer names it). Returns the store's data file fd when the ticket asked for it and the
    store gave it (direct reads), else None. Raises TandemError (FAILED_PRECONDITION) when
    the store refuses the region."""
    target = "\0" + address[1:] if address.startswith("@") else address
    message = store_pb2.RegionHandover(ticket=ticket).SerializeToString()
    received: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(target)
            socket.send_fds(conn, [message], [fd])
            conn.shutdown(socket.SHUT_WR)
            parts = []
            while True:
                data, fds, _, _ = socket.recv_fds(conn, 4096, 1)
                received += fds
                if not data:
                    break
                parts.append(data)
        reply = store_pb2.RegionHandoverReply.FromString(b"".join(parts))
        error = reply.error
    except OSError as exc:
        error, reply = f"the store's region socket {address!r}: {exc}", None
    if error:
        for extra in received:
            os.close(extra)
        raise FailedPrecondition(f"the store refused the region: {error}")
    if reply is not None and reply.data_file_refused:
        log.info("no direct reads: %s", reply.data_file_refused)
    for extra in received[1:]:
        os.close(extra)
    return received[0] if received else None


@dataclass(frozen=True)
class Span:
    """A page-aligned part of a region lent to one Get."""

    offset: int
    size: int


# Which store process and registration a Get named: its span's copy can only be running
# in that process, into that registration.
Tag = tuple[str, int]


class RegionReads:
    """A region shared by a client's concurrent Gets: each takes a span the size of its
    payload (first fit, page-aligned), held while the store writes into it and until its
    tensors are copied out or released by whoever holds them."""

    def __init__(self, region: SharedRegion, slots: int = 4) -> None:
        self.region = region
        usable = self.usable = region.size // PAGE * PAGE
        # The span a Get of unknown size takes: a slot, as before sizes were known.
        self.default_span = usable // slots // PAGE * PAGE
        if self.default_span <= 0:
            raise ValueError("the region is too small for its slots")
        self._lock = threading.Lock()
        self._free: list[Span] = [Span(DEFAULT_OFFSET, usable)]  # by offset, coalesced
        # Spans of Gets that failed while the store may still be copying into them (a
        # deadline, a lost connection), with the tag their Get named: never lent again
        # until that copy is known to be over (settle).
        self._retired: list[tuple[Span, Tag]] = []
        self.reads = 0  # Gets the store wrote into the region

    @property
    def tag(self) -> Tag:
        """What a Get starting now names: the store process and registration in force."""
        return self.region.store_instance, self.region.registration

    def acquire(self, nbytes: int = 0) -> Span | None:
        """A free span of at least nbytes (0: the default span); None when none is free
        (stream instead)."""
        size = -(-(nbytes or self.default_span) // PAGE) * PAGE
        with self._lock:
            for i, free in enumerate(self._free):
                if free.size >= size:
                    rest = Span(free.offset + size, free.size - size)
                    self._free[i : i + 1] = [rest] if rest.size else []
                    return Span(free.offset, size)
        return None

    def release(self, span: Span) -> None:
        with self._lock:
            spans = sorted([*self._free, span], key=lambda s: s.offset)
            merged: list[Span] = []
            for s in spans:
                if merged and merged[-1].offset + merged[-1].size == s.offset:
                    merged[-1] = Span(merged[-1].offset, merged[-1].size + s.size)
                else:
                    merged.append(s)
            self._free = merged

    def retire(self, span: Span, tag: Tag | None = None) -> None:
        with self._lock:
            self._retired.append((span, tag or self.tag))

    def needs_new_registration(self) -> bool:
        """Whether spans wait on a copy into the registration in force: registering anew
        (superseding it) is what lets them come back."""
        with self._lock:
            return any(tag == self.tag for _, tag in self._retired)

    def settle(self, instance: str, registration: int, superseded_copies: int) -> None:
        """After the store answered a registration: spans retired under another store
        process are free (that process is gone: a new one answers on its address and its
        data directory); those under an earlier registration of this one are free once no
        copy into one runs (the store starts none for a registration it superseded)."""
        with self._lock:
            kept: list[tuple[Span, Tag]] = []
            freed: list[Span] = []
            for span, (was, named) in self._retired:
                over = was != instance or (named != registration and not superseded_copies)
                if over:
                    freed.append(span)
                else:
                    kept.append((span, (was, named)))
            self._retired = kept
        for span in freed:
            self.release(span)

    def reclaim_retired(self) -> None:
        """Every retired span back (the caller knows the store is a new process)."""
        with self._lock:
            retired, self._retired = self._retired, []
        for span, _ in retired:
            self.release(span)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._free)

    @property
    def retired_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s, _ in self._retired)


class Arrival:
    """How much of one payload a progressive Get (progressive.py) has verified in the region
    (any thread)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.verified = 0
        self.error: TandemError | None = None
        self.ended = False
        self._changed = threading.Condition()
        self._on_end: list[Callable[[], None]] = []

    def advance(self, verified: int) -> None:
        with self._changed:
            self.verified = max(self.verified, verified)
            self._changed.notify_all()

    def end(self, error: TandemError | None) -> None:
        """The stream is over: the store writes no more into the span."""
        with self._changed:
            if error is None and self.verified < self.total:
                error = DataLoss("the store's answer ended before the payload was verified")
            self.error, self.ended = error, True
            callbacks, self._on_end = self._on_end, []
            self._changed.notify_all()
        for callback in callbacks:
            callback()

    def when_ended(self, callback: Callable[[], None]) -> None:
        """Runs callback once the stream is over (now, if it is)."""
        with self._changed:
            if not self.ended:
                self._on_end.append(callback)
                return
        callback()

    def wait(self, end: int, timeout: float | None = None) -> None:
        """Returns once payload bytes [0, end) are verified; raises the stream's error, or
        DataLoss when they did not arrive in time."""
        with self._changed:
            done = self._changed.wait_for(
                lambda: self.verified >= end or self.error is not None or self.ended, timeout
            )
            if self.verified >= end:
                return
            if self.error is not None:
                raise self.error
            raise DataLoss(
                "the payload stopped arriving" if done else "the payload did not arrive in time"
            )


class RegionHold:
    """A span holding a placed payload that its tensors still view: give it back with
    release() once they are copied (a hold dropped unreleased is given back when collected).
    A progressive Get's hold has an `arrival` (progressive.py): its span is given back only
    once the store writes no more into it."""

    def __init__(
        self,
        reads: RegionReads,
        span: Span,
        arrival: Arrival | None = None,
        tag: Tag | None = None,
    ) -> None:
        self.region = reads.region
        self.span = span
        self.arrival = arrival
        named = tag or reads.tag

        def give_back() -> None:
            if arrival is None:
                reads.release(span)
            else:
                arrival.when_ended(lambda: _after_stream(reads, span, arrival, named))

        self._finalizer = weakref.finalize(self, give_back)

    def release(self) -> None:
        self._finalizer()  # runs at most once

    @property
    def released(self) -> bool:
        return not self._finalizer.alive


def _after_stream(reads: RegionReads, span: Span, arrival: Arrival, tag: Tag) -> None:
    if arrival.error is None or not may_still_write(arrival.error):
        reads.release(span)
    else:
        reads.retire(span, tag)


def may_still_write(error: TandemError) -> bool:
    """Whether the store may still be copying into a span after a Get failed this way: not
    when it refused before copying or stopped on a damaged chunk; maybe when the call was
    cut (deadline, cancelled, connection lost, anything unexpected)."""
    return error.code not in SETTLED_CODES


def remove_stale_regions() -> list[str]:
    """Unlinks regions whose creating process is gone (one killed before it could close
    them: /dev/shm keeps them until reboot otherwise). Returns their names."""
    removed = []
    for path in SHM_DIR.glob("tandem-*-*"):
        pid = path.name.split("-")[1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(path.name)
        except PermissionError:
            pass  # alive, another user's
    return removed
