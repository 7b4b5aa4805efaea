"""One Put in progress: checks chunks as they arrive and writes them under a pending record id.

The header only becomes visible when the store commits the session (store.py); until
then the chunks are unreachable, and a crash leaves them as orphans that start-up collects.

`IdleLimited` bounds how long a Put stream may keep the store waiting for its next message.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from store_service.errors import IdleStream, InvalidRequest
from store_service.put_spec import PutSpec
from store_service.records import all_tensors, chunk_key, chunk_layout
from tandem_wire.checksum import crc32

# Chunks handed to the writer per LMDB transaction, and the most bytes one Put may have
# queued at the writer before it waits (bounds memory; keeps the gRPC receive and the
# LMDB write overlapping). Chosen by bench/store_bench.py.
GROUP_BYTES = 8 << 20
MAX_INFLIGHT_BYTES = 32 << 20
# The most bytes all Puts together may have queued at the writer: with many concurrent Puts
# the writer is the bottleneck, and without this each would hold MAX_INFLIGHT_BYTES of its own
# (16 x 64 MiB Puts peaked at ~1 GiB of heap). A Put over the budget waits, so its stream
# stops being read and gRPC's flow control slows its client.
TOTAL_INFLIGHT_BYTES = 96 << 20

WriteChunks = Callable[[list[tuple[bytes, bytes]]], "Future[Any]"]
T = TypeVar("T")


class IdleLimited(Generic[T]):
    """A Put's request stream whose next message must come within `idle_s` of being asked for.

    grpcio's sync server reads a client stream with a blocking `next` that nothing can
    interrupt, so a stream that never sends would hold its worker thread for good. Here a
    thread of this stream's own does the reading, one message at a time, only when the
    handler asks (flow control is unchanged: nothing is read ahead); the handler waits at
    most `idle_s` for it and then raises IdleStream (DEADLINE_EXCEEDED), which ends the call
    and gives the worker back. The reader, still blocked in `next`, ends with the call.
    Time the handler spends elsewhere (waiting for the writer) does not count.
    """

    _EMPTY: Any = object()

    def __init__(self, messages: Iterator[T], idle_s: float, rpc: str) -> None:
        self._messages = messages
        self._idle_s = idle_s
        self._rpc = rpc
        self._cond = threading.Condition()
        self._wanted = False
        self._closed = False
        self._item: Any = self._EMPTY
        self._error: BaseException | None = None
        self._done = False
        self._thread: threading.Thread | None = None

    def __iter__(self) -> IdleLimited[T]:
        return self

    def __next__(self) -> T:
        with self._cond:
            if self._done:
                raise StopIteration
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._read, name="store-put-reader", daemon=True
                )
                self._thread.start()
            self._wanted = True
            self._cond.notify_all()
            arrived = self._cond.wait_for(
                lambda: self._item is not self._EMPTY or self._done, self._idle_s
            )
            if not arrived:
                self._closed = self._done = True  # the reader drops whatever comes later
                self._cond.notify_all()
                raise IdleStream(
                    f"the {self._rpc} stream sent nothing for {self._idle_s:g} s, the most "
                    "the store waits for a client's next message (--put-idle-timeout-s); "
                    "the store ended it and stored nothing of its unfinished record: "
                    "send it again with its data ready"
                )
            if self._item is not self._EMPTY:
                item, self._item = self._item, self._EMPTY
                return item  # type: ignore[no-any-return]
            if self._error is not None:
                raise self._error
            raise StopIteration

    def close(self) -> None:
        """Lets the reader end (when the handler stops reading before the stream ends)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _read(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._wanted or self._closed)
                if self._closed:
                    return
                self._wanted = False
            item, error = self._EMPTY, None
            try:
                item = next(self._messages)
            except StopIteration:
                pass
            except BaseException as exc:  # noqa: BLE001 - handed to the handler's thread
                item, error = self._EMPTY, exc
            with self._cond:
                if self._closed:
                    return
                if item is self._EMPTY:
                    self._error, self._done = error, True
                    self._cond.notify_all()
                    return
                self._item = item
                self._cond.notify_all()


class InflightBudget:
    """Bytes queued at the writer by every Put, bounded; one Put may always go ahead."""

    def __init__(self, limit: int = TOTAL_INFLIGHT_BYTES) -> None:
        self.limit = limit
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        with self._cond:
            while self._used and self._used + nbytes > self.limit:
                self._cond.wait()
            self._used += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()

    @property
    def used(self) -> int:
        with self._cond:
            return self._used


class PutSession:
    def __init__(
        self,
        spec: PutSpec,
        record_id: int,
        chunk_bytes: int,
        write_chunks: WriteChunks,
        budget: InflightBudget | None = None,
    ) -> None:
        self._budget = budget or InflightBudget()
        self.spec = spec
        self.record_id = record_id
        self.chunk_bytes = chunk_bytes
        self.total = spec.payload_bytes
        self.received = 0
        self.chunk_crcs: list[int] = []
        self.wrote_any = False
        self._write_chunks = write_chunks
        self._slots = chunk_layout(spec.sizes, chunk_bytes)
        self._specs = all_tensors(spec.header)
        ends, offset = [], 0
        for size in spec.sizes:
            offset += size
            ends.append(offset)
        self._tensor_ends = ends
        self._slot = 0
        self._fill = bytearray()
        self._crc = 0
        self._group: list[tuple[bytes, bytes]] = []
        self._group_bytes = 0
        self._inflight: deque[tuple[Future[Any], int]] = deque()
        self._inflight_bytes = 0
        for spec_ in self._specs:
            if spec_.nbytes == 0 and spec_.crc32 != 0:
                raise InvalidRequest(f"checksum mismatch for empty tensor {spec_.name!r}")

    def write(self, offset: int, data: bytes) -> None:
        """Accepts the next slice of the payload."""
        if offset != self.received:
            raise InvalidRequest(
                f"chunk at offset {offset}, expected {self.received} (a chunk is missing "
                "or out of order)"
            )
        if self.received + len(data) > self.total:
            raise InvalidRequest(
                f"more bytes than declared: {self.received + len(data)} > {self.total}"
            )
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            slot = self._slots[self._slot]
            piece = view[pos : pos + slot.length - len(self._fill)]
            first_piece = not self._fill
            self._crc = crc32(piece, 0 if slot.starts_tensor and first_piece else self._crc)
            if first_piece and len(piece) == slot.length:
                # A whole stored chunk in one slice: keep the received bytes, no copy.
                self._complete(data if len(piece) == len(data) else bytes(piece))
            else:
                self._fill += piece
                if len(self._fill) == slot.length:
                    self._complete(bytes(self._fill))
                    self._fill = bytearray()
            pos += len(piece)
        self.received += len(data)

    def _complete(self, value: bytes) -> None:
        slot = self._slots[self._slot]
        self.chunk_crcs.append(self._crc)
        if slot.offset + slot.length == self._tensor_ends[slot.tensor]:
            spec = self._specs[slot.tensor]
            if self._crc != spec.crc32:
                raise InvalidRequest(
                    f"checksum mismatch for tensor {spec.name!r}: "
                    f"got {self._crc:#010x}, header says {spec.crc32:#010x}"
                )
        self._group.append((chunk_key(self.record_id, slot.index), value))
        self._group_bytes += len(value)
        self._slot += 1
        if self._group_bytes >= GROUP_BYTES:
            self._flush_group()

    def _flush_group(self) -> None:
        if not self._group:
            return
        nbytes = self._group_bytes
        self._budget.acquire(nbytes)
        future = self._write_chunks(self._group)
        future.add_done_callback(lambda _: self._budget.release(nbytes))
        self._inflight.append((future, nbytes))
        self.wrote_any = True
        self._inflight_bytes += self._group_bytes
        self._group, self._group_bytes = [], 0
        while self._inflight_bytes > MAX_INFLIGHT_BYTES:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        future, nbytes = self._inflight.popleft()
        self._inflight_bytes -= nbytes
        future.result()  # a write error surfaces here

    def finish(self) -> list[tuple[bytes, bytes]]:
        """Checks the payload is complete and waits until every chunk is written; returns
        the chunks of a put that never filled a group, unwritten: the commit writes them in
        its own transaction (a small record then costs the writer one transaction, not two,
        and a failed commit leaves no chunk behind)."""
        if self.received != self.total:
            raise InvalidRequest(f"payload ended at {self.received} of {self.total} bytes")
        if not self.wrote_any:
            pending, self._group, self._group_bytes = self._group, [], 0
            return pending
        self._flush_group()
        while self._inflight:
            self._wait_oldest()
        return []

    def drain(self) -> None:
        """Waits for queued writes, ignoring their errors (before cleaning up)."""
        while self._inflight:
            try:
                self._wait_oldest()
            except Exception:  # noqa: BLE001 - the put is being abandoned anyway
                pass
