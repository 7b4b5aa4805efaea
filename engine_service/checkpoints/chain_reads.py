"""Reading a generation's checkpoint chain: which segments the store holds, and how far
they continue one another (checkpoints/generation_loads.py reads them, checkpoints/
generations.py has the policy that writes them).

A chain's records as read: its base (a prompt's prefix record) when it rests on one, the
settled parts the manifest names and the run's segments it lists are required (missing:
NOT_FOUND; damaged: DATA_LOSS); the run's later segments, found by their index, are taken as
far as they run on without a gap, each starting where the tokens before it end and after the
same tokens (chain_tokens.py): one that does not is another run's, and the chain ends before
it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_service.checkpoints.chain_tokens import TokenDigest, continued
from engine_service.checkpoints.generation_meta import ChainBase
from engine_service.errors import Corrupt, NotFound
from tandem_client.record_reads import HeldRead
from tandem_client.records import Checkpoint, HeaderRead
from tandem_client.regions import RegionHold


@dataclass(frozen=True)
class HeldSegment:
    """A chain segment read, and the region span its tensors view (None: they own their
    bytes, or it is a header)."""

    checkpoint: Checkpoint
    hold: RegionHold | None

    @property
    def token_ids(self) -> list[int]:
        return self.checkpoint.token_ids

    @property
    def metadata(self) -> dict[str, str]:
        return self.checkpoint.metadata


def header_of(read: HeaderRead, index: int, required: bool) -> HeldSegment | None:
    """A chain segment's header as read, or None where an optional one is missing or
    damaged; a required one (the manifest lists it) missing is NOT_FOUND, damaged DATA_LOSS."""
    if read.checkpoint is not None:
        return HeldSegment(read.checkpoint, None)
    if not required:
        return None
    if read.damaged:
        raise Corrupt(f"segment {index} of this checkpoint is damaged in the store")
    raise NotFound(f"segment {index} of this checkpoint is not in the store")


def base_of(read: HeaderRead, base: ChainBase, tokens: list[int]) -> HeldSegment:
    """The header of the prefix record a chain rests on, required (missing: NOT_FOUND;
    damaged: DATA_LOSS), holding at least its positions and the generation's tokens there."""
    if read.checkpoint is None:
        if read.damaged:
            raise Corrupt("the prefix record this checkpoint rests on is damaged in the store")
        raise NotFound("the prefix record this checkpoint rests on is not in the store")
    held = read.checkpoint.token_ids
    if len(held) < base.tokens or list(held[: base.tokens]) != tokens[: base.tokens]:
        raise Corrupt("the prefix record this checkpoint rests on holds other tokens")
    return HeldSegment(read.checkpoint, None)


def held_base_of(read: HeldRead, others: list[HeldRead]) -> HeldSegment:
    """The base record's payload as read; missing or damaged, every span read (`others`
    too) is given back first."""
    (base,) = segments_of([read], 0, 1, also=others, what="the prefix record it rests on")
    assert base is not None
    return base


def segments_of(
    reads: list[HeldRead],
    first: int,
    required: int,
    also: list[HeldRead] | None = None,
    indices: Sequence[int] | None = None,
    what: str = "",
) -> list[HeldSegment | None]:
    """A chain's segments as read, from index `first` on; None where one of those written
    after the manifest (past the first `required`) is missing or damaged: the chain ends
    before it. A required one missing is NOT_FOUND, damaged DATA_LOSS, every span read given
    back first (`also`: other reads of the same call, given back too). indices: the reads'
    segment indices when they are not first, first + 1, ..."""
    parts: list[HeldSegment | None] = []
    for i, read in enumerate(reads):
        if read.checkpoint is not None:
            parts.append(HeldSegment(read.checkpoint, read.hold))
            continue
        parts.append(None)
        if i < required:
            for other in (*reads, *(also or [])):
                if other.hold is not None:
                    other.hold.release()
            index = indices[i] if indices is not None else first + i
            named = what or f"segment {index}"
            if read.damaged:  # the store set it aside
                raise Corrupt(f"{named} of this checkpoint is damaged in the store")
            raise NotFound(f"{named} of this checkpoint is not in the store")
    return parts


def gapless(segments: list[HeldSegment | None]) -> list[HeldSegment]:
    """The segments up to the first one missing."""
    run: list[HeldSegment] = []
    for segment in segments:
        if segment is None:
            break
        run.append(segment)
    return run


def continuing(chain: list[HeldSegment], listed: int, tokens: list[int]) -> list[HeldSegment]:
    """The chain as far as each segment written after the manifest (from index `listed`
    on) continues the tokens before it (`tokens`: the manifest's, then each segment's): it
    starts where they end, after the same tokens (chain_tokens.py). One that does not is
    another run's."""
    digest = TokenDigest()
    for i in range(listed, len(chain)):
        after = tokens_after(tokens, digest, chain[i])
        if after is None:
            return chain[:i]
        tokens = after
    return chain


def tokens_after(tokens: list[int], digest: TokenDigest, segment: HeldSegment) -> list[int] | None:
    """The generation's tokens after a later segment (chain_tokens.continued)."""
    return continued(tokens, digest, start_of(segment), segment.token_ids, segment.metadata)


def settled_before(
    parts: list[HeldSegment], first: HeldSegment, tokens: list[int], begins: int = 0
) -> bool:
    """Whether a chain's settled parts and its run's first segment hold positions `begins`
    (0, or where its base ends) on without a gap, and the manifest's tokens (`tokens`)
    between them."""
    end = begins
    for segment in (*parts, first):
        if (
            start_of(segment) != end
            or list(segment.token_ids) != tokens[end : end + len(segment.token_ids)]
        ):
            return False
        end += len(segment.token_ids)
    return end == len(tokens)


def start_of(segment: HeldSegment) -> int:
    try:
        return int(segment.metadata["start"])
    except (KeyError, ValueError) as exc:
        raise Corrupt(f"a checkpoint segment's metadata is malformed ({exc!r})") from exc
