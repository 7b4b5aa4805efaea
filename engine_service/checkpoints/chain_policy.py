"""Chain policy (all of it is here): what each snapshot of a generation's checkpoint chain
holds, which runs are broken, and the leases on the prefix records chains rest on.

A chain begins with a whole snapshot: every position, or those after its *base*, the
prompt's prefix record holding the row's first positions bit for bit (rest_on). *Runs* of at
most MAX_CHAIN segments follow, each segment the positions added since the one before; a
full run settles into a part and the parts merge a level at a time (next_segment). The chain
starts over with a whole snapshot when there is none yet, when it is too old to build on, or
when a segment, manifest or base lease did not reach the store (a hole is never built upon).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from engine_service.checkpoints.generation_meta import (
    MAX_CHAIN,
    MAX_PARTS,
    MERGE_FANOUT,
    BaseLease,
    ChainBase,
    segmentable,
)
from engine_service.checkpoints.spill import SpillQueue
from engine_service.checkpoints.spill_items import Pin
from engine_service.loop.jobs import ChainPart, Job, Segment


class ChainPolicy:
    def __init__(self, spill: SpillQueue | None) -> None:
        self.spill = spill
        self.base_lease_s = spill.lease_s if spill is not None else 600
        self._lock = threading.Lock()
        # Generation key -> first segment of a run that has a hole (a segment, manifest or
        # base lease that did not reach the store): its later records are not sent, its
        # next snapshot starts a new chain.
        self._broken: dict[bytes, int] = {}

    def next_segment(self, job: Job, held: int) -> Segment:
        """What a segmentable job's next snapshot holds (it advances the chain: capture it).

        A whole snapshot (the first, or after a record of the chain did not reach the store)
        begins the chain. A run that reached MAX_CHAIN segments settles: its first segment
        becomes a part of the chain, and the next run's first segment holds every position
        after it, in place of the run's later segments (deleted once its manifest is
        queued). Parts merge as a log-structured merge: MERGE_FANOUT - 1 parts of one level
        and the run after them become one part of the next level, so a position is stored
        again once a level, not once a run: a whole snapshot every MAX_CHAIN segments stored
        the prompt and every token again each time (with an 8,192-token prompt, ~950 MB a
        row of a 0.6B model every 256 tokens)."""
        chain = job.chain
        with self._lock:
            broken = self._broken.get(job.checkpoint_key) == chain.first
        # A whole snapshot's records are leased for lease_s from their Put and not renewed:
        # a chain older than half of that starts over (its parts stay as fresh as runs were).
        stale = time.monotonic() - chain.base_at > self.base_lease_s / 2
        full = chain.next_index - chain.first >= MAX_CHAIN
        index, head = chain.next_index, chain.head
        chain.next_index += 1
        if broken:
            chain.base = None  # its lease may be what failed: the chain starts at 0
        if (
            index == 0
            or chain.covered == 0
            or head is None
            or broken
            or (full and (stale or len(chain.parts) >= MAX_PARTS))
        ):
            # A whole snapshot: every position, or those after the chain's base (its lease
            # taken or renewed with it).
            start = chain.base.tokens if chain.base is not None else 0
            chain.first, chain.parts, chain.base_at = index, [], time.monotonic()
            chain.head, chain.covered = ChainPart(index, start, held, 0), held
            return Segment(index, index, start, base=chain.base)
        start, chain.covered = chain.covered, held
        if not full:
            listed = tuple(p.index for p in chain.parts)
            return Segment(index, chain.first, start, listed, base=chain.base)
        parts = [*chain.parts, head]
        dead = list(range(chain.first + 1, index))  # the run's later segments
        start, level = head.end, 1
        group = MERGE_FANOUT - 1
        while len(parts) > group and all(p.level == level for p in parts[-group:]):
            merged, parts = parts[-group:], parts[:-group]  # the whole snapshot stays
            start, level = merged[0].start, level + 1
            dead += [p.index for p in merged]
        chain.first, chain.parts, chain.head = index, parts, ChainPart(index, start, held, level)
        settled = tuple(p.index for p in parts)
        return Segment(index, index, start, settled, tuple(dead), chain.base)

    def rest_on(self, job: Job, base: ChainBase | None) -> None:
        """Before a job's first snapshot (MLX thread): its chain rests on `base`, a prefix
        record in the store holding the row's first base.tokens positions bit for bit (one
        the row restored, or the one its own prompt is saved as), so the chain does not
        store the prompt again: with an 8,192-token prompt, ~950 MB a row of a 0.6B model
        once more, and its copy off the device on the step loop. The record is pinned with
        the chain's first segment; if that fails the chain starts over at position 0."""
        if base is not None and self.spill is not None and segmentable(job.request.layout):
            job.chain.base = base
            job.chain.lease = BaseLease(base.key, job.request.namespace)

    def hold_base(self, job: Job) -> None:
        """A resumed job whose chain rests on a base (MLX thread): this engine takes a lease
        of its own on it (given back when the job ends); if the record is gone, the next
        snapshot starts the chain over."""
        base = job.chain.base
        if base is None or self.spill is None or not job.checkpoint_key:
            return
        job.chain.lease = BaseLease(base.key, job.request.namespace)
        self.pin(job, job.chain.first)

    def hooks(self, key: bytes, first: int) -> tuple[Callable[[], bool], Callable[[], None]]:
        """For what a chain's run (from segment `first`) sends: whether the run is still
        whole, and marking it broken (its next snapshot starts the chain over)."""

        def wanted() -> bool:
            with self._lock:
                return self._broken.get(key) != first

        def broke() -> None:
            with self._lock:
                self._broken[key] = first

        return wanted, broke

    def pin(self, job: Job, first: int) -> None:
        """Queues the lease on a job's chain base (taken, or renewed), ahead of the records
        that rest on it; a run whose base could not be pinned is not sent."""
        lease = job.chain.lease
        if lease is None or self.spill is None:
            return
        wanted, broke = self.hooks(job.checkpoint_key, first)
        holder = f"engine/{job.checkpoint_key.hex()[:12]}"
        self.spill.pin(Pin(lease, holder, still_wanted=wanted, on_failed=broke))

    def breaker(self, job: Job) -> Callable[[], None]:
        """What marks the job's live run broken (its next snapshot starts the chain over)."""
        return self.hooks(job.checkpoint_key, job.chain.first)[1]

    def forget(self, job: Job) -> None:
        """A generation that ended: the lease on its chain's base is given back (the record
        stays, a prefix like any other) and its broken mark goes."""
        if job.chain.lease is not None and self.spill is not None:
            self.spill.unpin(job.chain.lease)
        with self._lock:
            self._broken.pop(job.checkpoint_key, None)
