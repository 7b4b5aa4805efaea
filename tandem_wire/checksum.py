"""CRC-32 of payload bytes, as fast as this machine allows: one function for every side.

The stored and transferred checksums are zlib's CRC-32. python-isal computes the same values
with carry-less multiplication at ~9 GB/s a core (zlib's: ~2.7 GB/s here) and releases the
GIL, so checking a payload no longer costs more than copying it. Where isal has no wheel,
zlib's function is used: the same numbers, slower.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - platforms without an isal wheel
    _crc32 = zlib.crc32

crc32: Callable[[Any, int], int] = _crc32
