"""Where a request starts from: a cached prefix of its prompt, or its own generation checkpoint
(or why there was no prefix to reuse).

Made on the core's planning pool by core/planner.py (which may read the store), materialized into
caches on
the MLX thread (checkpoints/prefix_reuse.py, checkpoints/generations.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine_service.checkpoints.cache_records import CapturedCache
from engine_service.checkpoints.generation_meta import ChainBase
from engine_service.checkpoints.logprob_pages import LogprobLog
from engine_service.protocol.events import PrefixMissReason, PrefixSource, Token
from tandem_client.direct import DirectHold
from tandem_client.records import Attachment, Checkpoint
from tandem_client.regions import RegionHold
from tandem_client.same_host import ReadRoute


@dataclass
class PrefixPlan:
    """The longest cached prefix of a prompt: a capture in the local tier, or a store record."""

    matched: int  # prompt tokens it serves (after trimming)
    key: bytes
    layout: list[str]  # the request's cache layout
    local: CapturedCache | None = None  # a local hit: device arrays, restored without a copy
    stored: Checkpoint | None = None  # a store hit: the record's bytes
    # Where those bytes are when they still lie in the shared-memory region or, read
    # directly, in the store's data file (released once they are MLX arrays); None: they
    # are the checkpoint's own.
    hold: RegionHold | DirectHold | None = None
    fetch_s: float = 0.0
    # A record that cannot be trimmed (recurrent state, a wrapped window): it serves exactly
    # the length it holds, never less.
    exact: bool = False
    route: ReadRoute = "region"  # how a store hit's bytes came

    @property
    def source(self) -> Literal["local", "store"]:
        return "local" if self.local is not None else "store"

    @property
    def prefix_source(self) -> PrefixSource:
        if self.local is not None:
            return "local"
        sources: dict[ReadRoute, PrefixSource] = {
            "region": "store: region",
            "direct": "store: direct",
            "no region": "store: no region",
            "larger than the region": "store: larger than the region",
            "region busy": "store: region busy",
            "larger than the span": "store: larger than the span",
        }
        return sources[self.route]

    @property
    def arriving(self) -> bool:
        """Whether the store is still copying its bytes into the region (progressive Get)."""
        arrival = self.hold.arrival if self.hold is not None else None
        return arrival is not None and arrival.verified < arrival.total and not arrival.ended

    @property
    def nbytes(self) -> int:
        if self.local is not None:
            return self.local.nbytes
        return self.stored.payload_bytes if self.stored else 0


@dataclass(frozen=True)
class PrefixMiss:
    """A prompt looked up for reuse that found nothing usable, and why (Usage says so)."""

    reason: PrefixMissReason


@dataclass
class ResumePlan:
    """A generation checkpoint to continue from, read and checked against the request."""

    key: bytes
    generated: list[int]  # tokens emitted before the checkpoint
    pending: int  # sampled, not yet fed
    layout: list[str]
    # The cache records, oldest first: one whole snapshot, or the segments of a chain.
    parts: list[Checkpoint]
    chain_first: int = 0  # the live run's first segment and the next index to write
    chain_next: int = 0
    # The chain's settled parts before the run (their segment indices: parts' first ones),
    # and the first position the run's first segment holds.
    chain_parts: tuple[int, ...] = ()
    run_start: int = 0
    # The prefix record the chain rests on: then parts[0], its first base.tokens positions.
    base: ChainBase | None = None
    attachments: list[Attachment] = field(default_factory=list)  # checked companions
    fetch_s: float = 0.0
    # The region spans the parts' tensors still view (given back once they are arrays, or
    # by release() when the plan is dropped unused).
    holds: list[RegionHold] = field(default_factory=list)
    # A request that asked for logprobs (checkpoints/logprob_pages.py): those of the replayed
    # tokens its client does not hold, and the log its checkpoints' pages go on from.
    replay_logprobs: list[Token] = field(default_factory=list)
    logprob_log: LogprobLog | None = None

    def release(self) -> None:
        for hold in self.holds:
            hold.release()

    @property
    def replay(self) -> list[int]:
        """Every token the generation emitted, the pending one last."""
        return [*self.generated, self.pending]

    @property
    def nbytes(self) -> int:
        return sum(part.payload_bytes for part in self.parts)


Plan = PrefixPlan | ResumePlan | PrefixMiss | None
