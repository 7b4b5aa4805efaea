"""Page tables filled ahead of use: a shared-memory region's pages mapped into this process
before the first copy into them, which otherwise took a page fault a page (on 2 CPU cores a
chain of 30 MB read into a fresh region: 15.0 ms, into pages touched before: 9.9 ms).

`madvise(MADV_POPULATE_WRITE)` (Linux 5.14) maps pages writable without touching their bytes;
called through ctypes, which lets go of the GIL (mmap.madvise holds it: the process's other
threads waited ~14 ms a 64 MiB step on 2 cores). Python's mmap module names the flag only
from 3.12.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable
from errno import EINVAL

import numpy as np

MADV_POPULATE_WRITE = 23  # <linux/mman.h>
PAGE = mmap.PAGESIZE
STEP = 64 << 20  # bytes populated a call: the region is held only meanwhile

_libc = ctypes.CDLL(None, use_errno=True)


def populate(address: int, nbytes: int) -> str:
    """Maps [address, address + nbytes) ("" when done; else why not). A kernel older than
    5.14 has the pages read, a byte each, which maps them as well (a shared memory page
    read in is mapped writable: no fault at the first write either)."""
    if not _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), MADV_POPULATE_WRITE):
        return ""
    errno = ctypes.get_errno()
    if errno != EINVAL:
        return os.strerror(errno)
    pages = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
    pages[::PAGE].max()  # numpy lets go of the GIL over the reads
    return ""


def address_of(mapping: object) -> int:
    """A writable mapping's (mmap's) address, without keeping a view of it."""
    view = ctypes.c_char.from_buffer(mapping)  # type: ignore[arg-type]
    address = ctypes.addressof(view)
    del view
    return address


def populate_in_steps(
    address: int, nbytes: int, hold: Callable[[], bool], done: Callable[[], None]
) -> str:
    """`populate` a STEP at a time, each step between hold() (False: stop, the mapping is
    going) and done(), so the mapping is held only meanwhile; "" when all is mapped or it
    stopped, else why the kernel would not."""
    for offset in range(0, nbytes, STEP):
        if not hold():
            return ""
        try:
            problem = populate(address + offset, min(STEP, nbytes - offset))
        finally:
            done()
        if problem:
            return problem
    return ""
