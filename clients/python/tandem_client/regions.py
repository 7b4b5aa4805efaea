"""A shared-memory region for the store's same-host data plane (docs/store.md).

`SharedRegion(size)` creates /dev/shm/NAME (mode 0600: the store must run as the same user,
or the operator widens it), writes 32 random bytes at its start (the proof the store checks
when it is registered) and unlinks it on close. `StoreClient.register_region(region)` then
`get_into(key, namespace, region)` has the store copy a record's payload straight into it:
the tensors come back as views of the region, checked chunk by chunk by the store as it
copied. Linux only (POSIX shared memory under /dev/shm).
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from tandem_client.bulk import PayloadAssembler, RegionPut
from tandem_client.errors import DataLoss, TandemError
from tandem_client.records import Checkpoint
from tandem_wire.chunks import decode_chunk
from tandem_wire.pb import store_pb2

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
    }
)
PROOF_BYTES = 32
# Where get_into puts a payload by default: past the proof, page-aligned.
DEFAULT_OFFSET = 4096


class SharedRegion:
    def __init__(self, size: int, name: str = "") -> None:
        if size < DEFAULT_OFFSET:
            raise ValueError(f"a region needs at least {DEFAULT_OFFSET} bytes")
        self.name = name or f"tandem-{os.getpid()}-{secrets.token_hex(8)}"
        self.size = size
        self._path = SHM_DIR / self.name
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Every page reserved now: a full /dev/shm fails here (OSError), never as a
            # SIGBUS in the store when it writes.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:  # macOS
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            self._path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.proof = secrets.token_bytes(PROOF_BYTES)
        self._map[:PROOF_BYTES] = self.proof
        self.buf = memoryview(self._map)

    def close(self) -> None:
        """Removes the region; it is unmapped now, or when the last view of it goes (a
        checkpoint's tensors may still point into it)."""
        self._path.unlink(missing_ok=True)
        try:
            self.buf.release()
            self._map.close()
        except BufferError:
            pass  # views remain: the mapping goes with them

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


PAGE = 4096


@dataclass(frozen=True)
class Span:
    """A page-aligned part of a region lent to one Get."""

    offset: int
    size: int


class RegionReads:
    """A region shared by a client's concurrent Gets: each takes a span the size of its
    payload (first fit, page-aligned), held while the store writes into it and until its
    tensors are copied out or released by whoever holds them."""

    def __init__(self, region: SharedRegion, slots: int = 4) -> None:
        self.region = region
        usable = (region.size - DEFAULT_OFFSET) // PAGE * PAGE
        # The span a Get of unknown size takes: a slot, as before sizes were known.
        self.default_span = usable // slots // PAGE * PAGE
        if self.default_span <= 0:
            raise ValueError("the region is too small for its slots")
        self._lock = threading.Lock()
        self._free: list[Span] = [Span(DEFAULT_OFFSET, usable)]  # by offset, coalesced
        # Spans of Gets that failed while the store may still be copying into them (a
        # deadline, a lost connection): never lent again until the store is known to be a
        # new process (reclaim_retired), which cannot write into them.
        self._retired: list[Span] = []
        self.reads = 0  # Gets the store wrote into the region

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

    def retire(self, span: Span) -> None:
        with self._lock:
            self._retired.append(span)

    def reclaim_retired(self) -> None:
        """The store restarted (it did not know the region): its old copies are over."""
        with self._lock:
            retired, self._retired = self._retired, []
        for span in retired:
            self.release(span)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._free)

    @property
    def retired_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._retired)


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

    def __init__(self, reads: RegionReads, span: Span, arrival: Arrival | None = None) -> None:
        self.region = reads.region
        self.span = span
        self.arrival = arrival

        def give_back() -> None:
            if arrival is None:
                reads.release(span)
            else:
                arrival.when_ended(lambda: _after_stream(reads, span, arrival))

        self._finalizer = weakref.finalize(self, give_back)

    def release(self) -> None:
        self._finalizer()  # runs at most once

    @property
    def released(self) -> bool:
        return not self._finalizer.alive


def _after_stream(reads: RegionReads, span: Span, arrival: Arrival) -> None:
    if arrival.error is None or not may_still_write(arrival.error):
        reads.release(span)
    else:
        reads.retire(span)


def may_still_write(error: TandemError) -> bool:
    """Whether the store may still be copying into a span after a Get failed this way: not
    when it refused before copying or stopped on a damaged chunk; maybe when the call was
    cut (deadline, cancelled, connection lost, anything unexpected)."""
    return error.code not in SETTLED_CODES


def placement_in(region: SharedRegion, checkpoint: Checkpoint) -> RegionPut | None:
    """Where the checkpoint's tensors lie in region, when every one of them is a view of it
    (pushed there by the caller); None otherwise."""
    base = np.frombuffer(region.buf, np.uint8).ctypes.data
    offsets = []
    for tensor in checkpoint.all_tensors():
        data = memoryview(tensor.data)
        if not data.nbytes:
            offsets.append(DEFAULT_OFFSET)
            continue
        if not data.c_contiguous:
            return None
        at = np.frombuffer(data.cast("B"), np.uint8).ctypes.data - base
        if at < PROOF_BYTES or at + data.nbytes > region.size:
            return None
        offsets.append(at)
    return RegionPut(region.name, offsets)


def copy_into(region: SharedRegion, span: Span, checkpoint: Checkpoint) -> RegionPut:
    """Copies the checkpoint's tensors into span back to back (64-byte aligned)."""
    target = np.frombuffer(region.buf, np.uint8)
    offsets, at = [], span.offset
    for tensor in checkpoint.all_tensors():
        n = tensor.nbytes
        np.copyto(target[at : at + n], np.frombuffer(memoryview(tensor.data).cast("B"), np.uint8))
        offsets.append(at)
        at += _aligned(n)
    return RegionPut(region.name, offsets)


def put_span_bytes(checkpoint: Checkpoint) -> int:
    return sum(_aligned(t.nbytes) for t in checkpoint.all_tensors())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64  # a cache line: each tensor of a copied Put starts on one


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


def read_placed(
    messages: Iterable[bytes], region: SharedRegion, offset: int
) -> tuple[Checkpoint, bool]:
    """A Get-into-region's answer: (checkpoint, True) with tensors viewing the region where
    the store placed them, or (checkpoint, False) when the store streamed it instead."""
    stream = iter(messages)
    first = next(stream)
    second = next(stream, None)
    placed = _placement(second)
    if placed is None:  # streamed: header, then chunks
        assembler = PayloadAssembler(first)
        for raw in [second] if second is not None else []:
            assembler.feed(raw)
        for raw in stream:
            assembler.feed(raw)
        return assembler.finish(), False
    checkpoint = Checkpoint.from_header(store_pb2.GetResponse.FromString(first).header)
    placement_of(placed, region, offset, view_placed(checkpoint, region, offset))
    return checkpoint, True


def view_placed(checkpoint: Checkpoint, region: SharedRegion, offset: int) -> int:
    """Points the checkpoint's tensors at where a Get placed them (back to back from offset,
    in header order); returns the payload's size."""
    at = offset
    for tensor in checkpoint.all_tensors():
        tensor.data = region.buf[at : at + tensor.nbytes]
        at += tensor.nbytes
    return at - offset


def placement_of(
    placed: store_pb2.RegionPlacement, region: SharedRegion, offset: int, payload_bytes: int
) -> None:
    """Checks a `placed` message against what was asked and what the header says."""
    if placed.region != region.name or placed.offset != offset:
        raise DataLoss("the store placed the payload elsewhere than asked")
    if placed.payload_bytes != payload_bytes:
        raise DataLoss("the placed payload's size disagrees with the header")


def own_tensors(checkpoint: Checkpoint) -> None:
    """Copies a checkpoint's tensors out of the region into buffers of their own."""
    for tensor in checkpoint.all_tensors():
        owned = np.empty(tensor.nbytes, np.uint8)
        np.copyto(owned, np.frombuffer(tensor.data, np.uint8))
        tensor.data = memoryview(owned.data)


def _placement(raw: bytes | None) -> store_pb2.RegionPlacement | None:
    """The `placed` message of a Get into a region; None when the payload was streamed."""
    if raw is None or decode_chunk(raw) is not None:
        return None
    message = store_pb2.GetResponse.FromString(raw)
    return message.placed if message.WhichOneof("item") == "placed" else None
