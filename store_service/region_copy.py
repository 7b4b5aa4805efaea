"""Copies between LMDB and a caller's region (regions.py): a Get's payload into it, checked
chunk by chunk on several threads, in parts for progressive Gets; a Put's payload read out of it.

A region the store maps (sealed against shrinking: regions.py) is copied into directly; any
other is written with pwrite(2) and read with pread(2), so a caller that truncates its file
meanwhile costs itself its bytes (FAILED_PRECONDITION), never the store a SIGBUS.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from store_service import tables
from store_service.errors import Aborted, Corrupt, InvalidRequest, Precondition
from store_service.records import StoredRecord, chunk_key
from store_service.regions import Region
from store_service.storage import LmdbStorage
from tandem_wire.checksum import crc32

# Payloads up to this size are copied on the calling thread, in one read transaction: handing
# them to copy threads cost more than it saved (a chain's 1 MiB segments took 2.8 ms a Get on
# 2 cores, most of it the threads' hand-offs; docs/performance.md, seventh session).
INLINE_BYTES = 4 << 20

# The copy threads, by count: started once and shared by every Get (each Get used to start
# threads of its own).
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="region-copy")
        return pool


def copy_threads(configured: int) -> int:
    """Threads copying one Get's chunks (the copies and CRCs release the GIL): 4 was best on
    2 cores; on a 16-vCPU host 8 copied 18.4 GB/s, 16 only 12.7 and 32 12.5 (hyperthreads
    and memory bandwidth; bench/region_copy_ceiling.py, docs/performance.md)."""
    return configured or max(4, min(8, (os.cpu_count() or 1) // 2))


def region_payload(
    region: Region, offsets: Sequence[int], sizes: Sequence[int], piece: int
) -> Iterator[tuple[int, Any]]:
    """A Put's payload read out of the caller's region (PutHeader.region): (payload offset,
    bytes) pieces of each tensor at its offset, checked against the region's bounds. A
    mapped region is read through its mapping (the session copies each piece before the
    next is read), any other with pread(2)."""
    if len(offsets) != len(sizes):
        raise InvalidRequest(f"region_offsets: {len(offsets)} for {len(sizes)} tensors")
    at = 0
    for start, size in zip(offsets, sizes, strict=True):
        if start + size > region.size:
            raise InvalidRequest(
                f"a tensor at region offset {start} ({size} bytes) lies outside the region "
                f"(0..{region.size})"
            )
        for k in range(0, size, piece):
            n = min(piece, size - k)
            if region.map is not None:
                yield at + k, region.map[start + k : start + k + n]
                continue
            try:
                data = os.pread(region.fd, n, start + k)
            except OSError as exc:
                raise Precondition(
                    f"reading region {region.name!r} failed: {exc.strerror}"
                ) from None
            if len(data) != n:
                raise Precondition(f"region {region.name!r} is shorter than its registration")
            yield at + k, data
        at += size


def progress_part_bytes(payload_bytes: int) -> int:
    """A progressive Get's part: ~16 announcements a payload, none under 8 MiB (each costs
    a message and a barrier of the copy threads)."""
    return max(8 << 20, payload_bytes // 16)


def copy_in_parts(
    storage: LmdbStorage,
    record: StoredRecord,
    region: Region,
    offset: int,
    span: int,
    quarantine: Callable[[StoredRecord, str], None],
    threads: int = 4,
    part_bytes: int = 0,
) -> Generator[int, None, None]:
    """The record's payload into region at offset, chunk by chunk on several threads, each
    chunk checked against its stored CRC before it counts (chunk CRCs run per tensor, and
    every expected value is known, so chunks verify independently). Copies in parts of at
    least part_bytes (0: one part), in payload order, and yields after each part how many
    leading payload bytes are verified in the region; the next part is already being copied
    while the caller announces one. Closing the iterator early waits for that part.

    Raises Corrupt (the record is quarantined; the region's bytes past the last yielded
    count are not to be used) or Aborted (replaced or removed meanwhile).
    """
    region.check_room(offset, span, record.payload_bytes)
    target = None if region.map is None else np.frombuffer(region.map, np.uint8)
    chunks = storage.db["chunks"]
    slots = list(zip(record.slots, record.chunk_crcs, strict=True))
    prevs = [0 if s.starts_tensor else record.chunk_crcs[i - 1] for i, (s, _) in enumerate(slots)]

    def copy(indices: range) -> str:
        def read(txn: Any) -> str:
            for i in indices:
                slot, expected = slots[i]
                buf = txn.get(chunk_key(record.record_id, slot.index), db=chunks)
                if buf is None:
                    if tables.is_current(txn, storage.db, record):
                        return f"corrupt:chunk {slot.index} is missing"
                    return "gone"
                if len(buf) != slot.length or crc32(buf, prevs[i]) != expected:
                    return f"corrupt:chunk {slot.index} failed its checksum"
                start = offset + slot.offset
                if target is not None:
                    np.copyto(target[start : start + slot.length], np.frombuffer(buf, np.uint8))
                    continue
                try:
                    written = os.pwrite(region.fd, buf, start)
                except OSError as exc:
                    return f"region:writing into region {region.name!r} failed: {exc.strerror}"
                if written != slot.length:
                    return f"region:region {region.name!r} took a short write"
            return ""

        return str(storage.read(read, buffers=True))

    parts = _parts([slot.length for slot, _ in slots], part_bytes)
    inline = record.payload_bytes <= INLINE_BYTES
    workers = 1 if inline else max(1, min(threads, len(slots)))
    pool = None if inline else _pool(threads)

    def start(part: range) -> list[Future[str]]:
        every = range(part.start, part.stop)
        if pool is None:
            done: Future[str] = Future()
            done.set_result(copy(every))
            return [done]
        return [pool.submit(copy, every[w::workers]) for w in range(min(workers, len(every)))]

    running = start(parts[0]) if parts else []
    try:
        for k, part in enumerate(parts):
            problems = [p for p in (f.result() for f in running) if p]
            running = start(parts[k + 1]) if not problems and k + 1 < len(parts) else []
            if problems:
                _raise_for(problems, record, quarantine)
            if region.map is None and region.shrank():  # pwrite would have grown it back
                raise Precondition(f"region {region.name!r} shrank while it was written")
            last_slot = slots[part.stop - 1][0]
            yield last_slot.offset + last_slot.length
    finally:
        wait(running)  # closed early or failed: the copies under way end before it returns


def _parts(lengths: list[int], part_bytes: int) -> list[range]:
    """Consecutive slot ranges of at least part_bytes each (the last may be smaller)."""
    parts, begin, size = [], 0, 0
    for i, length in enumerate(lengths):
        size += length
        if part_bytes and size >= part_bytes:
            parts.append(range(begin, i + 1))
            begin, size = i + 1, 0
    if begin < len(lengths):
        parts.append(range(begin, len(lengths)))
    return parts


def _raise_for(
    problems: list[str], record: StoredRecord, quarantine: Callable[[StoredRecord, str], None]
) -> None:
    if "gone" in problems:
        raise Aborted("the record was replaced or removed while it was being read")
    corrupt = [p.removeprefix("corrupt:") for p in problems if p.startswith("corrupt:")]
    if corrupt:
        quarantine(record, corrupt[0])
        raise Corrupt(
            f"stored {corrupt[0]} ({record.header.key.hex()}); the record is quarantined "
            "and the region's bytes are not to be used"
        )
    # the caller's region, not the record: nothing of it to use either
    raise Precondition(problems[0].removeprefix("region:"))
