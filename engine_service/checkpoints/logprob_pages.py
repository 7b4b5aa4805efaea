"""A checkpointed generation's log-probabilities, kept beside its checkpoint: what a resume
sends with the tokens it replays that its client does not hold.

A generation checkpoint holds caches and tokens, not the log-probabilities each token was
emitted with; a request that asked for them (`logprobs`) and resumes holding fewer tokens than
the checkpoint replays (its last chunks lost with the engine) would get those tokens bare. So
the tokens' log-probabilities go to the store too, in *pages* of PAGE_TOKENS tokens: small
metadata-only records under keys derived from the generation key (one GetHeaders reads many).
The page being filled is written again with each snapshot, before the snapshot's own records
(the spill queue keeps order): a snapshot in the store has its pages there before it. When the
generation ends, its last page is written unpinned beside the tombstone (a finished
generation's tail is replayed from it). Values are stored as computed (float32), so a resume
sends the very bits the lost chunks carried.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine_service.checkpoints.spill import SpillQueue
from engine_service.checkpoints.spill_items import Put
from engine_service.errors import Precondition
from engine_service.protocol.events import Token
from tandem_client.errors import TandemError
from tandem_client.records import Checkpoint
from tandem_client.store_client import StoreClient

log = logging.getLogger(__name__)

PAGE_TOKENS = 32  # a snapshot writes its page again: about 16-32 entries a row a round
_HEADERS_A_CALL = 64  # GetHeaders' most keys a call


def page_of(index: int) -> int:
    return index // PAGE_TOKENS


def page_key(generation_key: bytes, page: int) -> bytes:
    return hashlib.blake2b(
        generation_key + b"/logprobs/" + page.to_bytes(4, "big"), digest_size=32
    ).digest()


@dataclass
class PagesRead:
    """What a resume read of a generation's pages: the entries of its tokens, by index, and
    the whole pages before its last one, as stored (its log puts them again: their lease)."""

    entries: dict[int, Token] = field(default_factory=dict)
    whole: dict[int, Checkpoint] = field(default_factory=dict)


@dataclass
class LogprobLog:
    """A checkpointed generation's entries from `start` on (the first of the page its
    snapshots write next; those before are in the store), by token index (MLX thread): the
    Token events it sent, with their log-probabilities."""

    start: int = 0
    entries: list[Token] = field(default_factory=list)
    written: int = 0  # entries before this index are in pages already queued
    # The pages it filled, as sent, and when (time.monotonic()): put again before their
    # lease lapses while the generation runs (queue_pages), as a chain starts over before
    # its whole snapshot's does (checkpoints/chain_policy.py).
    filled: dict[int, tuple[Checkpoint, float]] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.start + len(self.entries)

    def note(self, index: int, entry: Token) -> None:
        """Token `index`'s entry; one noted already (a pending token's, then its emission)
        is kept as it is. After a gap (never: every token is noted in order) the log starts
        again at the next page, whose entries it can still write whole."""
        if index < self.end:
            return
        if index > self.end:
            log.error("logprob log of %d entries skipped to %d", self.end, index)
            self.start = self.written = (page_of(index) + 1) * PAGE_TOKENS
            self.entries = []
            return
        self.entries.append(entry)

    @classmethod
    def resumed(cls, read: PagesRead, replayed: int) -> LogprobLog:
        """The log of a generation resumed after `replayed` tokens, from its pages read back:
        the last page's entries (without them, it starts at the next page), and the whole
        pages before it, put again at its first snapshot (a lease of this engine's)."""
        found, first = read.entries, page_of(replayed) * PAGE_TOKENS
        filled = {page: (record, -math.inf) for page, record in read.whole.items()}
        if all(i in found for i in range(first, replayed)):
            entries = [found[i] for i in range(first, replayed)]
            return cls(first, entries, replayed, filled)
        after = (page_of(replayed) + 1) * PAGE_TOKENS
        return cls(after, [], after, filled)

    def pages_due(self) -> list[tuple[int, list[Token]]]:
        """The pages holding entries not written yet: (first index, entries), each from its
        page's first entry the log holds. The log then keeps only the last page's."""
        if self.written >= self.end:
            return []
        pages = []
        for page in range(page_of(max(self.written, self.start)), page_of(self.end - 1) + 1):
            first = max(page * PAGE_TOKENS, self.start)
            last = min((page + 1) * PAGE_TOKENS, self.end)
            pages.append((first, self.entries[first - self.start : last - self.start]))
        self.written = self.end
        keep_from = max(page_of(self.end) * PAGE_TOKENS, self.start)
        self.entries = self.entries[keep_from - self.start :]
        self.start = keep_from
        return pages

    def queue_pages(
        self,
        spill: SpillQueue,
        generation_key: bytes,
        namespace: str,
        model_id: str,
        layout: list[str],
        pinned: bool = True,
        on_failed: Callable[[], None] | None = None,
        now: float | None = None,
    ) -> Callable[[], bool]:
        """Queues the pages due (pages_due) ahead of a snapshot: leased like its records
        while the generation runs (the filled ones put again once half their lease is gone),
        unpinned beside its tombstone. Returns whether all of them landed, so far (asked on
        the spill thread, before the snapshot is sent: a snapshot whose pages did not land
        would be resumed with an older run's entries there)."""
        lost = threading.Event()

        def failed() -> None:
            lost.set()
            if on_failed is not None:
                on_failed()

        now = time.monotonic() if now is None else now
        for first, entries in self.pages_due():
            page = page_record(generation_key, first, entries, namespace, model_id, layout)
            spill.put(Put(page, 0, pinned=pinned, on_failed=failed))
            if page_of(first) < page_of(self.end):  # never written again
                self.filled[page_of(first)] = (page, now)
        for index, (page, at) in list(self.filled.items()) if pinned else []:
            if now - at > spill.lease_s / 2:
                spill.put(Put(page, 0, on_failed=failed))
                self.filled[index] = (page, now)
        return lambda: not lost.is_set()


def page_record(
    generation_key: bytes,
    first: int,
    entries: Sequence[Token],
    namespace: str,
    model_id: str,
    layout: list[str],
) -> Checkpoint:
    """A page as a metadata-only store record (entries from token index `first` on)."""
    top_n = min((len(e.top or ()) for e in entries), default=0)
    ids = [[t for t, _ in (e.top or [])[:top_n]] for e in entries]
    values = [[v for _, v in (e.top or [])[:top_n]] for e in entries]
    return Checkpoint(
        key=page_key(generation_key, page_of(first)),
        kind="object",
        namespace=namespace,
        model_id=model_id,
        layout=layout,
        token_ids=[e.token_id for e in entries],
        trimmable=False,
        metadata={
            "logprobs_of": generation_key.hex(),
            "first": str(first),
            "top_n": str(top_n),
            "logprobs": _b64(np.asarray([e.logprob for e in entries], "<f4")),
            "top_ids": _b64(np.asarray(ids, "<i4")),
            "top_values": _b64(np.asarray(values, "<f4")),
        },
    )


def entries_of(record: Checkpoint, generation_key: bytes) -> dict[int, Token]:
    """A page record's entries by token index (ValueError: not a page of this generation, or
    malformed)."""
    meta = record.metadata
    if meta.get("logprobs_of") != generation_key.hex():
        raise ValueError("a record of another generation")
    first, top_n, count = int(meta["first"]), int(meta["top_n"]), len(record.token_ids)
    logprobs = _array(meta["logprobs"], "<f4", (count,))
    ids = _array(meta["top_ids"], "<i4", (count, top_n))
    values = _array(meta["top_values"], "<f4", (count, top_n))
    out = {}
    for i, token in enumerate(record.token_ids):
        top = [(int(t), float(v)) for t, v in zip(ids[i], values[i], strict=True)]
        out[first + i] = Token(int(token), float(logprobs[i]), top)
    return out


def read_pages(
    store: StoreClient,
    generation_key: bytes,
    namespace: str,
    tokens: Sequence[int],
    first: int,
) -> PagesRead:
    """The entries the store holds of tokens[first:] (indices into the generation), each for
    the token there; a page missing, damaged or another run's leaves its indices out."""
    read = PagesRead()
    if first >= len(tokens):
        return read
    pages = list(range(page_of(first), page_of(len(tokens) - 1) + 1))
    for at in range(0, len(pages), _HEADERS_A_CALL):
        batch = pages[at : at + _HEADERS_A_CALL]
        try:
            headers = store.get_headers([page_key(generation_key, p) for p in batch], namespace)
        except TandemError as exc:
            log.warning("logprob pages could not be read (%s)", exc)
            return read
        for page, header in zip(batch, headers, strict=True):
            if header.checkpoint is None:
                continue
            try:
                entries = entries_of(header.checkpoint, generation_key)
            except (KeyError, ValueError) as exc:
                log.warning("logprob page %d is malformed (%r); left out", page, exc)
                continue
            ours = {
                i: e
                for i, e in entries.items()
                if first <= i < len(tokens) and e.token_id == tokens[i]
            }
            read.entries.update(ours)
            if len(ours) == PAGE_TOKENS and page < page_of(len(tokens)):
                read.whole[page] = header.checkpoint
    return read


def replay_entries(
    found: dict[int, Token], tokens: Sequence[int], held: int, top_n: int
) -> list[Token]:
    """The entries a resume sends with tokens[held:], each cut to the request's top_n;
    Precondition when the store does not hold one of them (the client then resumes holding
    them, or without logprobs)."""
    missing = [i for i in range(held, len(tokens)) if i not in found]
    short = [i for i in range(held, len(tokens)) if i in found and len(found[i].top or ()) < top_n]
    if missing or short:
        at = min(missing + short)
        raise Precondition(
            f"this generation's checkpoint holds no log-probabilities for tokens {at} to "
            f"{len(tokens) - 1}{f' with {top_n} alternatives' if short else ''}, which the "
            f"client does not hold (tokens_held {held}); resume holding {len(tokens)} tokens, "
            "or without logprobs"
        )
    return [
        Token(e.token_id, e.logprob, (e.top or [])[:top_n])
        for e in (found[i] for i in range(held, len(tokens)))
    ]


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode("ascii")


def _array(text: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    data = base64.b64decode(text, validate=True)
    array = np.frombuffer(data, dtype)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{array.size} values where {shape} were expected")
    return array.reshape(shape)
