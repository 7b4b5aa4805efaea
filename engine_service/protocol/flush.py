"""What a flush barrier reports: the core fills it in (checkpoints/spill.py), the front turns
it into a FlushResponse."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FlushResult:
    durable: bool  # everything acknowledged since the last barrier is on the store's disk
    flushed: int = 0  # puts that landed since the last barrier
    missing: int = 0  # dropped for lack of queue room
    failed: int = 0  # sent and refused or unreachable
