"""The store's data file as a direct Get's reader sees it (docs/store.md, "Direct reads").

A same-host client of every namespace is handed the store's LMDB data file, open read-only,
at its region's handover. It maps the file once and reads each direct Get's chunks at the
offsets the store answered, while the store's lease keeps those pages in place. The
client never opens LMDB: the offsets come from the store, which alone reads the file's
structure.

Python's mmap module refuses a mapping longer than the file, and the file grows; so the
mapping is made through libc with a fixed reservation (`RESERVE`), one base address for the
file's whole life (a GPU registers ranges of it once). Pages past the file's end are never
touched: a lease's chunks lie inside the file, which LMDB never shrinks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from dataclasses import dataclass

from tandem_client.errors import FailedPrecondition

RESERVE = 1 << 40  # address space, not memory: a data file up to 1 TiB
_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@dataclass(frozen=True)
class FileIdentity:
    device: int
    inode: int


class DataFile:
    """The store's data file, mapped read-only. Views of it keep it mapped; it is unmapped
    (and its fd closed) once neither the client nor any view holds it."""

    def __init__(self, fd: int) -> None:
        st = os.fstat(fd)
        self.identity = FileIdentity(st.st_dev, st.st_ino)
        address = _libc.mmap(None, RESERVE, _PROT_READ, _MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"mapping the store's data file: {os.strerror(err)}")
        self.fd = fd
        self.base: int = address
        # One view of the whole reservation (no memory): a chunk's view is a slice of it.
        whole = (ctypes.c_char * RESERVE).from_address(address)
        whole.owner = self  # type: ignore[attr-defined]  # the mapping outlives every view
        self._whole = memoryview(whole).cast("B")
        self._lock = threading.Lock()
        self._closed = False
        self._size = 0

    def size(self) -> int:
        self._size = os.fstat(self.fd).st_size
        return self._size

    def view(self, offset: int, length: int) -> memoryview:
        """length bytes at offset: a view into the mapping (no copy). Raises
        FailedPrecondition for a range past the file's end (a wrong or stale offset)."""
        end = offset + length
        if offset < 0 or length < 0 or end > RESERVE or (end > self._size and end > self.size()):
            raise FailedPrecondition(
                f"bytes {offset}..{offset + length} lie outside the store's data file"
            )
        return self._whole[offset:end]

    def __del__(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _libc.munmap(self.base, RESERVE)
        os.close(self.fd)
