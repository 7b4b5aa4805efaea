"""Shared-memory regions: the same-host data plane (docs/store.md, "Shared-memory regions").

A caller on the store's host creates a POSIX shared-memory file (/dev/shm/NAME), writes 32
random bytes at its start and registers it (name, size, those bytes as proof). A Get naming
the region then has the store copy the record's payload straight from its LMDB map into the
region, with several threads, each stored chunk checked against its CRC as it is copied; the
reply carries only the header. Regions belong to the principal that registered them (auth) and
hold a lease: a caller that goes away without unregistering loses its region when the lease
lapses, and the store unmaps it. The store never unlinks a region: its creator owns it.

A region owned by another user is written with pwrite(2), never through a mapping: if its
owner truncates it meanwhile that costs the owner its bytes, never the store a SIGBUS. One
owned by the store's own user is mapped and copied into (~40% faster here): a process of the
same user could kill the store outright anyway.
(multiprocessing.shared_memory is not used: its resource tracker, Python < 3.13, would unlink
the creator's region when the store exits.)
"""

from __future__ import annotations

import hmac
import mmap
import os
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from store_service import tables
from store_service.errors import (
    Aborted,
    Corrupt,
    InvalidRequest,
    NotFound,
    Overloaded,
    Precondition,
)
from store_service.records import StoredRecord, chunk_key
from store_service.storage import LmdbStorage
from tandem_wire.checksum import crc32

SHM_DIR = Path("/dev/shm")
PROOF_BYTES = 32
DEFAULT_TTL_S = 60
MAX_TTL_S = 3600
MAX_NAME_CHARS = 200
MAX_REGIONS = 64  # per store: each is a mapping the store holds open


def copy_threads(configured: int) -> int:
    """Threads copying one Get's chunks (the copies and CRCs release the GIL): 4 was best on
    2 cores; on a 16-vCPU host 8 copied 18.4 GB/s, 16 only 12.7 and 32 12.5 (hyperthreads
    and memory bandwidth; bench/region_copy_ceiling.py, docs/performance.md)."""
    return configured or max(4, min(8, (os.cpu_count() or 1) // 2))


@dataclass
class Region:
    name: str
    owner: str
    fd: int  # O_RDWR on /dev/shm/NAME
    size: int
    expires_ms: int
    map: mmap.mmap | None = None  # the store's own user's region: copied into directly
    busy: int = 0  # Gets copying into it now (closed once they are done)

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
        os.close(self.fd)

    def fits(self, offset: int, span: int, nbytes: int) -> bool:
        end = min(self.size, offset + span) if span else self.size
        return 0 <= offset and offset + nbytes <= end

    def check_room(self, offset: int, span: int, nbytes: int) -> None:
        if not self.fits(offset, span, nbytes):
            raise Overloaded(
                f"region {self.name!r} holds {self.size} bytes; {nbytes} bytes from offset "
                f"{offset} (span {span or 'to its end'}) do not fit"
            )


class Regions:
    def __init__(self, copy_threads: int = 4) -> None:
        self.copy_threads = copy_threads  # per Get into a region
        self._lock = threading.Lock()
        self._regions: dict[tuple[str, str], Region] = {}
        self._closing: list[Region] = []  # released while a Get was copying into them

    def register(
        self, owner: str, name: str, size: int, proof: bytes, ttl_s: int, now_ms: int
    ) -> int:
        """Maps a caller's region (or renews its lease); returns when the lease ends."""
        check_region_name(name)
        if len(proof) != PROOF_BYTES:
            raise InvalidRequest(f"region proof: the region's first {PROOF_BYTES} bytes")
        ttl = min(ttl_s or DEFAULT_TTL_S, MAX_TTL_S)
        expires = now_ms + ttl * 1000
        with self._lock:
            self._expire(now_ms)
            held = self._regions.get((owner, name))
            if held is not None and held.size == size:
                if not hmac.compare_digest(os.pread(held.fd, PROOF_BYTES, 0), proof):
                    raise Precondition(f"region {name!r}: the proof does not match its bytes")
                held.expires_ms = expires
                return expires
            if len(self._regions) >= MAX_REGIONS:
                raise Overloaded(f"the store holds {MAX_REGIONS} regions already")
        fd = _open(name, size, proof)
        with self._lock:
            old = self._regions.pop((owner, name), None)
            mapped = mmap.mmap(fd, size) if os.fstat(fd).st_uid == os.geteuid() else None
            self._regions[(owner, name)] = Region(name, owner, fd, size, expires, mapped)
            if old is not None:
                self._release(old)
        return expires

    def unregister(self, owner: str, name: str) -> None:
        check_region_name(name)
        with self._lock:
            region = self._regions.pop((owner, name), None)
        if region is None:
            raise NotFound(f"no region {name!r} registered by this caller")
        with self._lock:
            self._release(region)

    def get(self, owner: str, name: str, now_ms: int) -> Region:
        """A caller's own live region (another caller's name is simply not found), held for
        a copy until done(region)."""
        check_region_name(name)
        with self._lock:
            self._expire(now_ms)
            region = self._regions.get((owner, name))
            if region is None:
                raise NotFound(
                    f"no region {name!r} registered by this caller (or its lease lapsed)"
                )
            region.busy += 1
        return region

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
        with self._lock:
            for region in regions:
                self._release(region)

    def _expire(self, now_ms: int) -> None:
        for key in [k for k, r in self._regions.items() if r.expires_ms <= now_ms]:
            self._release(self._regions.pop(key))

    def _release(self, region: Region) -> None:
        if region.busy:  # a Get is copying into it: closed when it is done
            self._closing.append(region)
        else:
            region.close()


def check_region_name(name: str) -> None:
    """A region name is a file name under /dev/shm: printable (no NUL, which no path may
    hold), no slashes, not hidden, at most 200 characters. Raises InvalidRequest."""
    if (
        not name
        or "/" in name
        or name.startswith(".")
        or len(name) > MAX_NAME_CHARS
        or not name.isprintable()
    ):
        raise InvalidRequest(
            f"region name: a file name under /dev/shm of up to {MAX_NAME_CHARS} printable "
            "characters, without slashes"
        )


def _open(name: str, size: int, proof: bytes) -> int:
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise NotFound(f"no shared-memory region {name!r} on the store's host") from None
    except OSError as exc:
        raise Precondition(f"region {name!r} cannot be opened: {exc.strerror}") from None
    try:
        actual = os.fstat(fd).st_size
        if actual != size or size < PROOF_BYTES:
            raise InvalidRequest(f"region {name!r} is {actual} bytes, not {size}")
        if not hmac.compare_digest(os.pread(fd, PROOF_BYTES, 0), proof):
            raise Precondition(f"region {name!r}: the proof does not match its first bytes")
    except BaseException:
        os.close(fd)
        raise
    return fd


def region_payload(
    region: Region, offsets: Sequence[int], sizes: Sequence[int], piece: int
) -> Iterator[tuple[int, Any]]:
    """A Put's payload read out of the caller's region (PutHeader.region): (payload offset,
    bytes) pieces of each tensor at its offset, checked against the region's bounds. The
    store's own user's region is read through its mapping (the session copies each piece
    before the next is read), another user's with pread(2)."""
    if len(offsets) != len(sizes):
        raise InvalidRequest(f"region_offsets: {len(offsets)} for {len(sizes)} tensors")
    at = 0
    for start, size in zip(offsets, sizes, strict=True):
        if start < PROOF_BYTES or start + size > region.size:
            raise InvalidRequest(
                f"a tensor at region offset {start} ({size} bytes) lies outside the region's "
                f"payload space ({PROOF_BYTES}..{region.size})"
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
    workers = max(1, min(threads, len(slots)))

    def start(part: range) -> list[Future[str]]:
        every = range(part.start, part.stop)
        return [pool.submit(copy, every[w::workers]) for w in range(min(workers, len(every)))]

    with ThreadPoolExecutor(workers, thread_name_prefix="region-copy") as pool:
        running = start(parts[0]) if parts else []
        for k, part in enumerate(parts):
            problems = [p for p in (f.result() for f in running) if p]
            running = start(parts[k + 1]) if not problems and k + 1 < len(parts) else []
            if problems:
                _raise_for(problems, record, quarantine)
            last_slot = slots[part.stop - 1][0]
            yield last_slot.offset + last_slot.length


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
