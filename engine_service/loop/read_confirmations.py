"""Rows admitted over a direct store hit still to be confirmed (checkpoints/prefix_reuse.py).

Such a row's first step runs over arrays the store has not vouched for yet (the gather
overlaps the forward pass). Right after that step, before any event of the row leaves, each
read is confirmed: the store's check passed and the lease held. A row whose read is not
confirmed starts again by recompute; its Started then says it reused nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine_service.checkpoints.prefix_reuse import PrefixReuse, UnconfirmedRead
from engine_service.loop.jobs import Job
from engine_service.protocol.checkpoint_stats import CheckpointCounters
from engine_service.protocol.events import Started


@dataclass(frozen=True)
class Unconfirmed:
    """A row admitted over a direct store hit, and the Started it says once the read is
    confirmed (None: a row coming back, which says none)."""

    job: Job
    read: UnconfirmedRead
    started: Started | None


@dataclass(frozen=True)
class Outcome:
    """What the scheduler does for one confirmed (or refused) row."""

    job: Job
    started: Started | None  # to emit now (None: nothing)
    recompute: bool  # out of the batch, to start again from its tokens


class ReadConfirmations:
    def __init__(self) -> None:
        self._pending: list[Unconfirmed] = []

    def add(self, job: Job, read: UnconfirmedRead, started: Started | None) -> None:
        self._pending.append(Unconfirmed(job, read, started))

    def __bool__(self) -> bool:
        return bool(self._pending)

    def confirm_all(
        self, prefixes: PrefixReuse, counters: CheckpointCounters, live: Mapping[str, Job]
    ) -> list[Outcome]:
        """Confirms every pending read (MLX thread). A row no longer live (not in `live` by
        its request id: it ended meanwhile, e.g. at its deadline) gets nothing; its read is
        confirmed all the same, to end its lease."""
        pending, self._pending = self._pending, []
        outcomes = []
        for item in pending:
            confirmed = prefixes.confirm(item.read)
            if not confirmed:
                counters.miss("not restorable")
            if live.get(item.job.request.request_id) is not item.job:
                continue
            started = item.started
            if not confirmed and started is not None:
                started = Started(started.prompt_tokens, 0, "not restorable")
            outcomes.append(Outcome(item.job, started, recompute=not confirmed))
        return outcomes
