"""Is an LMDB data file whole? Checked before the file is mapped.

LMDB maps `data.mdb` and trusts it: a file cut short (a disk fault, a copy interrupted, a
full disk during a copy) makes the first read of a missing page a SIGBUS that kills the
process with nothing on stderr. py-lmdb exposes no check, so this reads LMDB's two meta pages
itself (format: lmdb `mdb.c`, `MDB_meta` after the 16-byte page header; stable since LMDB
0.9) and compares the file's size with the end of the last page the newest meta uses.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0xBEEFC0DE
_PAGE_HEADER = 16
_META = struct.Struct("<II")  # mm_magic, mm_version (then address, mapsize, two MDB_db)
_DB_BYTES = 48  # one MDB_db
_PSIZE_AT = _PAGE_HEADER + 24  # the free DB's md_pad holds the page size in a meta page
_TAIL_AT = _PAGE_HEADER + 24 + 2 * _DB_BYTES  # mm_last_pg, mm_txnid
_TAIL = struct.Struct("<QQ")
_PAGE_SIZES = (4096, 8192, 16384, 32768, 65536)


@dataclass(frozen=True)
class MetaPage:
    page_size: int
    last_page: int
    txn_id: int

    @property
    def needed_bytes(self) -> int:
        return (self.last_page + 1) * self.page_size


class DamagedDataFile(Exception):
    """The file cannot be opened safely; the message names it and what to do."""


def _meta(raw: bytes, offset: int) -> MetaPage | None:
    if len(raw) < offset + _TAIL_AT + _TAIL.size:
        return None
    magic, _ = _META.unpack_from(raw, offset + _PAGE_HEADER)
    if magic != MAGIC:
        return None
    (page_size,) = struct.unpack_from("<I", raw, offset + _PSIZE_AT)
    last_page, txn_id = _TAIL.unpack_from(raw, offset + _TAIL_AT)
    return MetaPage(page_size, last_page, txn_id)


def check(path: Path) -> MetaPage | None:
    """Raises DamagedDataFile unless `path` is absent, empty or a whole LMDB data file;
    returns the newest meta page it found."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(2 * max(_PAGE_SIZES))
    first = _meta(head, 0)
    metas = [first] if first is not None else []
    sizes = [first.page_size] if first is not None else list(_PAGE_SIZES)
    for page_size in sizes:
        second = _meta(head, page_size)
        if second is not None:
            metas.append(second)
    metas = [m for m in metas if m.page_size in _PAGE_SIZES]
    if not metas:
        raise DamagedDataFile(
            f"{path} is not an LMDB data file (no valid meta page): restore it from a backup, "
            "or move it away to start an empty store"
        )
    newest = max(metas, key=lambda m: m.txn_id)
    if size < newest.needed_bytes:
        raise DamagedDataFile(
            f"{path} is truncated: {size} bytes, but its last page ends at "
            f"{newest.needed_bytes} bytes; restore it from a backup, or move it away to start "
            "an empty store"
        )
    return newest
