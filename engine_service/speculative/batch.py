"""Speculative rows in one batch: the requests that asked for speculation draft together and
are verified together, each row with its own draft length, acceptance and rollback.

A round, for B rows (mlx-lm's `speculative_generate_step` algorithm, batched):
- draft: the draft model feeds each row the two tokens it owes (below), then its own
  proposals one at a time, K = the largest draft length of the round; a row asking for fewer
  ignores the proposals past its own;
- verify: one target call over K + 1 positions ([pending, d1..dK] a row);
- accept: row i keeps the prefix of its k_i proposals the target agrees with (n_i of them)
  plus the target's own next token, sampled with the key of its generated index;
- roll back: the target gives back K - n_i positions a row, the draft what it fed past its
  invariant. Batch caches do this per row (`rollback`: a trim of what every row gives back
  and a right shift of the rest, kv/batch_cache.py and kv/ring_cache.py). Recurrent layers
  (mlx-lm's `ArraysCache`) cannot give positions back: their state from before the verify
  is restored and the accepted tokens are fed again, right-padded, with the cache's
  `lengths` telling each row where its state stops (what mlx-lm's padded prefill uses).

Invariants between rounds, per row: the target holds every token of `history` but the last
(`pending`: sampled, not fed); the draft holds every token but the last two (it feeds them
first next round: one fixed width for every row), or nothing while the history is a single
token (then the row does not draft that round).

No library batches speculation (mlx-lm's BatchGenerator has no speculative mode and its
generator keeps rejected positions in its caches between yields), hence this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from engine_service.kv.batch_cache import BatchQuantizedKVCache, adopt_row
from engine_service.kv.planes import FULL_WIDTH_PLANES
from engine_service.protocol.engine_stats import SpeculativeCounters
from engine_service.protocol.kv_codec import PLAIN_KV, KVCodec
from engine_service.protocol.sampling_options import SamplingOptions
from engine_service.sampling.samplers import SeededSampler

Processor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class SpecRow:
    """One speculative row between rounds (see the module docstring's invariants)."""

    request_id: str
    history: list[int]  # the context: prompt + generated, `pending` last
    step: int  # the generated index of the next token sampled (the one after `pending`)
    num_draft: int
    options: SamplingOptions
    processors: list[Processor] = field(default_factory=list)
    kv: KVCodec = PLAIN_KV
    drafted: int = 0
    accepted: int = 0
    rollbacks: int = 0  # rounds in which it rejected proposals
    sampler: SeededSampler | None = None

    def __post_init__(self) -> None:
        if self.sampler is None and not self.options.greedy:
            self.sampler = SeededSampler(self.options)

    @property
    def pending(self) -> int:
        return self.history[-1]

    @property
    def plain_greedy(self) -> bool:
        return self.sampler is None and not self.processors

    def draft_length(self, remaining: int) -> int:
        """Proposals this round: its own length, one less than it may still generate, none
        while the draft holds nothing; and a row whose KV converts to a quantized codec at
        `start` does not cross it inside a round (positions before it are computed plain,
        after it quantized, as step-by-step decoding computes them)."""
        if len(self.history) < 2:
            return 0
        k = max(0, min(self.num_draft, remaining - 1))
        held = len(self.history) - 1
        if self.kv.quantized and held < self.kv.start:
            k = min(k, self.kv.start - held - 1)
        return k

    def pick(self, logprobs: mx.array, step: int, context: list[int]) -> mx.array:
        """Token at generated index `step` from one position's logprobs (1, vocab)."""
        if self.processors:
            tokens = mx.array(context)
            for processor in self.processors:
                logprobs = processor(tokens, logprobs)
            logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if self.sampler is None:
            return mx.argmax(logprobs, axis=-1)
        self.sampler.step = step
        return self.sampler(logprobs)


@dataclass
class RowRound:
    """What one round gave a row."""

    tokens: list[int]  # accepted proposals + the target's next token
    logprobs: list[mx.array]  # per token, over the vocabulary
    drafted: int
    accepted: int


class SpeculativeBatch:
    """The speculative rows, their target and draft batch caches (one per layer)."""

    def __init__(
        self,
        target: Any,
        draft: Any,
        counters: SpeculativeCounters | None = None,
        wide_reads: bool = FULL_WIDTH_PLANES,
    ) -> None:
        self.target, self.draft = target, draft
        # Attention over whole step-grown planes (BatchQuantizedKVCache.wide_reads), on
        # MLX-CUDA by default: its attention over several query positions builds a kernel per
        # key length (~65 ms on an H200, a new length every round without wide reads).
        self.wide_reads = wide_reads
        self.rows: list[SpecRow] = []
        self.target_cache: list[Any] = []
        self.draft_cache: list[Any] = []
        # Rounds, proposals and row rollbacks, every round together (the engine's Stats).
        self.counters = counters if counters is not None else SpeculativeCounters()

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: SpecRow, target_cache: list[Any], draft_cache: list[Any]) -> None:
        """Joins a row whose solo caches hold history[:-1] (target) and history[:-2] (draft)."""
        target = _as_batch([adopt_row(c, row.kv) for c in target_cache])
        draft = _as_batch([adopt_row(c, PLAIN_KV) for c in draft_cache])
        self.target_cache = _extend(self.target_cache, target)
        try:
            self.draft_cache = _extend(self.draft_cache, draft)
        except Exception:  # the row joins both batches or neither
            kept = list(range(len(self.rows)))
            if kept:
                for cache in self.target_cache:
                    cache.filter(kept)
            else:
                self.target_cache = []
            raise
        for cache in (*self.target_cache, *self.draft_cache):
            if isinstance(cache, BatchQuantizedKVCache):
                cache.wide_reads = self.wide_reads
        self.rows.append(row)

    def index(self, request_id: str) -> int:
        return next(i for i, r in enumerate(self.rows) if r.request_id == request_id)

    def remove(self, request_id: str) -> None:
        i = self.index(request_id)
        keep = [j for j in range(len(self.rows)) if j != i]
        del self.rows[i]
        if not keep:
            self.target_cache, self.draft_cache = [], []
            return
        for cache in (*self.target_cache, *self.draft_cache):
            cache.filter(keep)

    def extract(self, request_id: str) -> tuple[list[Any], list[Any]]:
        """A row's caches as solo caches (copies): the target's and the draft's."""
        i = self.index(request_id)
        return [c.extract(i) for c in self.target_cache], [c.extract(i) for c in self.draft_cache]

    # -- a round -----------------------------------------------------------------------------

    def round(self, remaining: list[int]) -> list[RowRound]:
        """One round for every row; `remaining`: tokens each row may still generate (>= 1)."""
        rows = self.rows
        ks = [row.draft_length(left) for row, left in zip(rows, remaining, strict=True)]
        k = max(ks)
        drafts = self._draft(k)
        verify = mx.array([[row.pending] for row in rows], mx.uint32)
        if k:
            verify = mx.concatenate([verify, mx.stack(drafts, axis=1)], axis=1)
        saved = self._recurrent_state()
        logits = self.target(verify, cache=self.target_cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = self._pick(logprobs, drafts, first=0, count=k + 1)
        mx.eval(picked, *drafts)
        targets: list[list[int]] = picked.tolist()  # type: ignore[assignment]
        proposed = _ints_by_row(drafts, len(rows))
        agreed = []
        for t, d, ki in zip(targets, proposed, ks, strict=True):
            n = 0
            while n < ki and t[n] == d[n]:
                n += 1
            agreed.append(n)
        self._roll_back_target(k, agreed, verify, saved)
        self._roll_back_draft(k, agreed)
        self.counters.rounds_total += 1
        results = []
        for i, (row, n, ki) in enumerate(zip(rows, agreed, ks, strict=True)):
            out = targets[i][: n + 1]
            row.history += out
            row.step += n + 1
            row.drafted += ki
            row.accepted += n
            if n < ki:
                row.rollbacks += 1
                self.counters.rollbacks_total += 1
            self.counters.drafted_total += ki
            self.counters.accepted_total += n
            results.append(RowRound(out, [logprobs[i, j] for j in range(n + 1)], ki, n))
        return results

    def _draft(self, k: int) -> list[mx.array]:
        """K proposals a row, (B,) each. The first call feeds the two owed tokens (a row with
        a one-token history feeds its token twice and drafts nothing); when no row drafts,
        that call still runs, so the draft keeps its invariant."""
        owed = [[row.history[-2 if len(row.history) > 1 else -1], row.pending] for row in self.rows]
        y = mx.array(owed, mx.uint32)
        drafts: list[mx.array] = []
        for i in range(max(k, 1)):
            logits = self.draft(y, cache=self.draft_cache)[:, -1, :]
            if i >= k:
                break
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picks = self._pick(logprobs[:, None, :], drafts, first=i, count=1)[:, 0]
            picks = picks.astype(mx.uint32)
            mx.async_eval(picks)
            drafts.append(picks)
            y = picks[:, None]
        return drafts

    def _pick(self, logprobs: mx.array, drafts: list[mx.array], first: int, count: int) -> mx.array:
        """Tokens at generated indices step + first .. step + first + count - 1 of each row,
        from logprobs (B, count, vocab) whose position i follows the history and the first
        + i proposals; (B, count). Greedy rows without processors: one batched argmax."""
        rows = self.rows
        if all(row.plain_greedy for row in rows):
            return mx.argmax(logprobs, axis=-1)
        proposed = _ints_by_row(drafts, len(rows)) if any(r.processors for r in rows) else None
        out = []
        for j, row in enumerate(rows):
            picks = []
            for i in range(first, first + count):
                context = row.history + proposed[j][:i] if proposed is not None else []
                at = logprobs[j, i - first : i - first + 1]
                picks.append(row.pick(at, row.step + i, context))
            out.append(mx.concatenate(picks))
        return mx.stack(out)

    # -- rollbacks ---------------------------------------------------------------------------

    def _recurrent_state(self) -> list[list[Any]] | None:
        """The recurrent layers' state before the verify (MLX arrays are immutable: holding
        the references is the snapshot)."""
        layers = [c for c in self.target_cache if isinstance(c, ArraysCache)]
        return [list(c.cache) for c in layers] if layers else None

    def _roll_back_target(
        self, k: int, agreed: list[int], verify: mx.array, saved: list[list[Any]] | None
    ) -> None:
        fed = k + 1
        back = [fed - (n + 1) for n in agreed]
        if not any(back):
            return
        if saved is None:
            _roll_back(self.target_cache, back)
            return
        # Recurrent layers: every layer back to before the verify, then the kept tokens fed
        # again (right-padded; the recurrent state stops at each row's length).
        layers = [c for c in self.target_cache if isinstance(c, ArraysCache)]
        for layer, state in zip(layers, saved, strict=True):
            layer.cache = state
        _roll_back(self.target_cache, [fed] * len(agreed))
        width = max(agreed) + 1
        replay = verify[:, :width]
        for layer in layers:
            layer.prepare(lengths=[n + 1 for n in agreed])
        self.target(replay, cache=self.target_cache)
        for layer in layers:
            layer.finalize()
        _roll_back(self.target_cache, [width - (n + 1) for n in agreed])

    def _roll_back_draft(self, k: int, agreed: list[int]) -> None:
        fed = k + 1 if k else 2
        back = []
        for row, n in zip(self.rows, agreed, strict=True):
            held_before = max(len(row.history) - 2, 0)
            keep = len(row.history) + n + 1 - 2 - held_before  # history not yet extended
            back.append(fed - keep)
        _roll_back(self.draft_cache, back)


def prefilled(
    model: Any, tokens: list[int], step: int = 2048, cache: list[Any] | None = None, held: int = 0
) -> list[Any]:
    """A solo cache holding `tokens`: fed `step` at a time past the `held` a given cache has."""
    cache = cache if cache is not None else make_prompt_cache(model)
    for start in range(held, len(tokens), step):
        model(mx.array(tokens[start : start + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def _roll_back(caches: list[Any], counts: list[int]) -> None:
    if not any(counts):
        return
    for cache in caches:
        if isinstance(cache, ArraysCache):
            continue  # restored from its snapshot by the caller
        cache.rollback(counts)


def _as_batch(row_caches: list[Any]) -> list[Any]:
    """One row's solo layer caches as batch caches of one row (each layer's `merge`)."""
    return [c.merge([c]) for c in row_caches]


def _extend(batch: list[Any], other: list[Any]) -> list[Any]:
    if not batch:
        return other
    if len(other) != len(batch):  # checked before any layer changes
        raise ValueError(f"a row of {len(other)} layers cannot join a batch of {len(batch)}")
    for a, b in zip(batch, other, strict=True):
        a.extend(b)
    return batch


def _ints_by_row(drafts: list[mx.array], batch: int) -> list[list[int]]:
    """Proposals so far as token lists, one a row."""
    if not drafts:
        return [[] for _ in range(batch)]
    listed: Any = mx.stack(drafts, axis=1).tolist()
    return [[int(t) for t in row] for row in listed]
