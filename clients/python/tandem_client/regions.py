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
import queue
import secrets
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from tandem_client.bulk import PayloadAssembler
from tandem_client.errors import DataLoss
from tandem_client.records import Checkpoint
from tandem_wire.chunks import decode_chunk
from tandem_wire.pb import store_pb2

SHM_DIR = Path("/dev/shm")
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


class RegionReads:
    """A region shared by a client's concurrent Gets: `slots` spans, each held by one read
    while the store writes into it and the tensors are copied out."""

    def __init__(self, region: SharedRegion, slots: int = 4) -> None:
        self.region = region
        self.span = (region.size - DEFAULT_OFFSET) // slots // 4096 * 4096
        if self.span <= 0:
            raise ValueError("the region is too small for its slots")
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(slots):
            self._free.put(DEFAULT_OFFSET + i * self.span)
        self.reads = 0  # Gets the store wrote into the region

    def acquire(self) -> int | None:
        """A free span's offset; None when every span is in use (stream instead)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def release(self, offset: int) -> None:
        self._free.put(offset)


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
    if placed.region != region.name or placed.offset != offset:
        raise DataLoss("the store placed the payload elsewhere than asked")
    checkpoint = Checkpoint.from_header(store_pb2.GetResponse.FromString(first).header)
    at = offset
    for tensor in checkpoint.all_tensors():
        tensor.data = region.buf[at : at + tensor.nbytes]
        at += tensor.nbytes
    if at - offset != placed.payload_bytes:
        raise DataLoss("the placed payload's size disagrees with the header")
    return checkpoint, True


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
