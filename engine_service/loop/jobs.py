"""A request inside the engine loop (`Job`), and the checkpoint state it carries."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from engine_service.checkpoints.attachments import CapturedAttachment
from engine_service.checkpoints.cache_records import CapturedCache
from engine_service.checkpoints.chain_tokens import TokenDigest
from engine_service.checkpoints.generation_meta import BaseLease, ChainBase
from engine_service.checkpoints.logprob_pages import LogprobLog
from engine_service.checkpoints.prefix_reuse import UnconfirmedRead
from engine_service.core.plans import Plan, PrefixPlan, ResumePlan
from engine_service.protocol.events import Finished, PrefixMissReason, PrefixSource, Sink, Token
from engine_service.protocol.requests import GenerationRequest
from engine_service.sampling.constraints import ConstrainedRow
from engine_service.sampling.samplers import requested_logprobs


@dataclass(frozen=True)
class ChainPart:
    """A settled segment of a chain, before its live run: the whole snapshot it began with
    (level 0, from position 0), or a run's first segment, which holds positions since the
    part before it (level 1: one run's; each level up merges MERGE_FANOUT of the one below)."""

    index: int
    start: int
    end: int
    level: int


@dataclass
class ChainCursor:
    """Where a generation's append-only checkpoint chain stands (plain KV caches only)."""

    next_index: int = 0  # segments numbered so far (every index ever used)
    first: int = 0  # the first segment of the live run
    covered: int = 0  # cache positions the live chain's segments hold
    # The settled parts before the live run, in position order (checkpoints/generations.py),
    # and the live run's first segment.
    parts: list[ChainPart] = field(default_factory=list)
    head: ChainPart | None = None
    base_at: float = 0.0  # time.monotonic() when the chain's whole snapshot was taken (0: unknown)
    # The generation's tokens as far as its later segments named them (chain_tokens.py).
    tokens: TokenDigest = field(default_factory=TokenDigest)
    # The prompt's prefix record the chain rests on (None: it starts at position 0), and the
    # store's lease on it that this engine holds (its id set by the spill thread).
    base: ChainBase | None = None
    lease: BaseLease | None = None


@dataclass(frozen=True)
class Segment:
    """One snapshot as a chain segment: its index, its run's first segment, and the first
    cache position it holds (0: the chain starts here with a whole snapshot)."""

    index: int
    first: int  # its run's first segment
    start: int
    # The settled parts its run continues (their indices, in position order); none for a
    # run that starts at position 0 (its first is the chain's whole snapshot).
    parts: tuple[int, ...] = ()
    # The segments its run's manifest makes dead (the run before, and the parts merged).
    dead: tuple[int, ...] = ()
    base: ChainBase | None = None  # the prefix record the chain rests on (start from its end)


@dataclass
class PendingSnapshot:
    """A generation capture waiting for its pending token (sampled one step later)."""

    captured: CapturedCache
    generated: list[int]  # tokens emitted when it was taken
    segment: Segment | None  # None: a whole snapshot under the generation key
    attachments: list[CapturedAttachment] = field(default_factory=list)


@dataclass
class ReadySnapshot:
    """A pending snapshot whose pending token is now known: ready to be saved."""

    job: Job
    snapshot: PendingSnapshot
    pending: int


@dataclass
class Job:
    request: GenerationRequest
    sink: Sink
    plan: Plan = None
    uid: int = -1  # the BatchGenerator row; -1 while waiting or in the speculative lane
    tokens: list[int] = field(default_factory=list)  # generated so far (resumed ones too)
    constrained: ConstrainedRow | None = None  # its structured-output processor, in a batch
    checkpoint_key: bytes = b""
    options_digest: str = ""  # its sampling options' digest, hex (generation_meta.py)
    checkpointed: bool = False  # something of it is in (or on its way to) the store
    keep_checkpoint: bool = False  # a client that went away may come back and resume
    snapshot: PendingSnapshot | None = None
    last_checkpoint_at: int = 0  # len(tokens) at the last generation snapshot
    chain: ChainCursor = field(default_factory=ChainCursor)
    # The store record its caches' first positions were restored from, bit for bit (None:
    # computed here): what its checkpoint chain may rest on (chain_policy.rest_on).
    restored_prefix: ChainBase | None = None
    admitted_at: float = 0.0
    # When the core received it (time.monotonic): a burst is gathered from arrivals, so a
    # request that spent its window being planned (a store read) is not held for it again.
    arrived_at: float = field(default_factory=time.monotonic)
    planned_at: float = field(default_factory=time.monotonic)  # handed to the MLX thread
    recompute: bool = False  # starts again from its tokens alone (its batch step failed)
    # Its first token, sent before the step that reports it (first_tokens.py `_send_first_tokens`).
    token_sent_ahead: int | None = None
    # Its stream has ended (a Finished was emitted): nothing more is sent to it. A row whose
    # first token ends it is told so with that token, and leaves the batch a step later.
    stream_ended: bool = False
    id_released: bool = False  # its request id may be used again (admissions.leave)
    turn_start: int = 0  # len(tokens) when it last got its slot (loop/turns.py)
    # A checkpointed request that asked for logprobs: its tokens' entries, for the pages its
    # snapshots write beside them (checkpoints/logprob_pages.py).
    logprob_log: LogprobLog | None = None
    # How it ended, for the tombstone a resume reads (checkpoints/generations.forget).
    ended: Literal["finished", "was cancelled", "failed"] = "finished"

    @property
    def resumed(self) -> bool:
        return isinstance(self.plan, ResumePlan)

    def admit(self) -> None:
        self.admitted_at = time.monotonic()

    def finished_by(self, reason: str, token: int) -> Finished:
        """What its stream says when its last token (just added) ended it: a stop token
        ("stop") or its token budget ("length"). A constrained row whose matcher failed mid-
        row (a parser limit) allows only EOS: that is a stop too, marked incomplete."""
        stop = token if reason == "stop" else None
        cut = self.constrained is not None and not self.constrained.complete(self.tokens)
        return Finished(
            "stop" if stop is not None else "length", stop_token=stop, constraint_incomplete=cut
        )

    def ending_at(self, token: int) -> Finished | None:
        """How its stream ends if `token` (not added yet) ends it, as mlx-lm's BatchGenerator
        will decide a step later: a stop token, or the last of its budget. None: it goes on,
        or it is a constrained row (whose end depends on its matcher)."""
        if self.constrained is not None:
            return None
        if token in self.request.stop_ids:
            return Finished("stop", stop_token=token)
        return Finished("length") if self.remaining <= 1 else None

    def token_event(self, index: int, token: int, logprobs: Any) -> Token:
        """The event of its token `index` (`logprobs`: that position's over the vocabulary),
        with the log-probabilities it asked for, noted for its checkpoints' pages."""
        event = Token(token, *requested_logprobs(logprobs, token, self.request.sampling.logprobs))
        if self.logprob_log is not None and event.logprob is not None:
            self.logprob_log.note(index, event)
        return event

    def note_pending(self, token: int, logprobs: Any) -> None:
        """Notes the entry of its pending token (sampled, not sent yet) for a snapshot saved
        before that token is sent: the snapshot's pages then hold it (token_event)."""
        if self.logprob_log is not None:
            self.token_event(len(self.tokens), token, logprobs)

    def at_first_new_token(self, sent_ahead: bool = False) -> bool:
        """Whether the token just added (sent_ahead: about to be sent, not added yet) is the
        first this process generated for it (a resumed job starts with the tokens its
        checkpoint replays)."""
        replayed = len(self.plan.replay) if isinstance(self.plan, ResumePlan) else 0
        return len(self.tokens) + sent_ahead == replayed + 1

    def first_token_phases(self) -> str:
        """Where its time to a first token (now) went inside the core: planning (its store
        reads), waiting for the MLX thread, then restore, prefill and the step to it; after
        the way it started (a store hit, a local one, a resume, a prefill)."""
        now = time.monotonic()
        plan = self.plan
        if isinstance(plan, PrefixPlan):
            start = "store hit" if plan.stored is not None else "local hit"
        else:
            start = "resume" if isinstance(plan, ResumePlan) else "prefill"
        return (
            f"{start} (ms): plan {(self.planned_at - self.arrived_at) * 1e3:.1f}, "
            f"wait {(self.admitted_at - self.planned_at) * 1e3:.1f}, "
            f"restore and step {(now - self.admitted_at) * 1e3:.1f}"
        )

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.tokens)

    @property
    def turn(self) -> int:
        """Tokens generated since it last got its slot."""
        return len(self.tokens) - self.turn_start


@dataclass(frozen=True)
class StartingPoint:
    """What a job's first model call feeds, over which caches."""

    feed: list[int]  # tokens to feed now
    history: list[int]  # tokens already in the caches
    caches: list[Any] | None  # None: fresh caches
    cached_prompt_tokens: int  # reused (history may hold more: a prefix snapshot's prefill)
    prefix_miss_reason: PrefixMissReason = ""  # why it reused nothing (Started says so)
    prefix_source: PrefixSource = ""  # where what it reused came from
    # A direct store hit in use before the store's verdict: confirmed after the first step.
    unconfirmed: UnconfirmedRead | None = None
