"""Speculative decoding for one request: a draft model proposes, the target verifies.

This is mlx-lm's `speculative_generate_step` algorithm (draft k tokens one at a time, verify
them with one target call over k + 1 positions, keep the agreeing prefix plus the target's
own next token, trim both caches) written as a round-by-round object instead of a generator.
Why not call mlx-lm's generator: between its yields the caches hold rejected draft positions,
and the draft's not-yet-processed tokens live in its local variables, so there is no point at
which its state can be checkpointed and rebuilt. Here a round ends with both caches trimmed
and that state named (`pending`, `draft_pending`), which is what a checkpoint stores.

Sampling is per position with our keyed sampler: generated token t is drawn with the key of
(seed, t) from the target's distribution, exactly as the non-speculative path draws it, so
speculation changes speed, never the tokens (up to floating-point differences between a
one-position and a k + 1-position target call). The draft samples with the same keys, which
makes it agree more often when the two distributions are close.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from engine_service.sampling import SamplingOptions, SeededSampler

Processor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class RoundResult:
    tokens: list[int]
    logprobs: list[mx.array]  # per token, over the vocabulary
    drafted: int  # draft tokens proposed this round
    accepted: int  # of which the target agreed with


class SpeculativeDecoder:
    """One request's target and draft caches between rounds.

    Invariant between rounds: the target cache holds every token but `pending` (sampled, not
    fed); the draft cache holds every token but `draft_pending + [pending]`.
    """

    def __init__(
        self,
        target: Any,
        draft: Any,
        target_cache: list[Any],
        draft_cache: list[Any],
        pending: int,
        draft_pending: list[int],
        history: list[int],
        options: SamplingOptions,
        processors: list[Processor],
        num_draft: int,
    ) -> None:
        self.target, self.draft = target, draft
        self.target_cache, self.draft_cache = target_cache, draft_cache
        self.pending = pending
        self.draft_pending = list(draft_pending)
        self.history = list(history)  # tokens fed to the target, plus pending: the context
        self.step = 0  # index of the next generated token (set by the caller)
        self.options = options
        self.processors = processors
        self.num_draft = num_draft
        self._sampler = None if options.greedy else SeededSampler(options)
        self.drafted_total = 0
        self.accepted_total = 0

    @classmethod
    def prefill(
        cls,
        target: Any,
        draft: Any,
        prompt: list[int],
        options: SamplingOptions,
        processors: list[Processor],
        num_draft: int,
        target_cache: list[Any] | None = None,
        cached: int = 0,
        draft_cache: list[Any] | None = None,
        draft_cached: int = 0,
        prefill_step: int = 2048,
    ) -> SpeculativeDecoder:
        """Feeds prompt[:-1] to both models (skipping what their caches already hold)."""
        target_cache = target_cache if target_cache is not None else make_prompt_cache(target)
        draft_cache = draft_cache if draft_cache is not None else make_prompt_cache(draft)
        feed_prompt(target, target_cache, prompt[cached:-1], prefill_step)
        feed_prompt(draft, draft_cache, prompt[draft_cached:-1], prefill_step)
        return cls(
            target,
            draft,
            target_cache,
            draft_cache,
            prompt[-1],
            [],
            prompt,
            options,
            processors,
            num_draft,
        )

    def _pick(self, logprobs: mx.array, step: int, context: list[int]) -> mx.array:
        """The token at generated index `step` from one position's logprobs (1, vocab)."""
        if self.processors:
            tokens = mx.array(context)
            for processor in self.processors:
                logprobs = processor(tokens, logprobs)
            logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if self._sampler is None:
            return mx.argmax(logprobs, axis=-1)
        self._sampler.step = step
        return self._sampler(logprobs)

    def round(self, remaining: int) -> RoundResult:
        """Drafts up to num_draft tokens, verifies them, and returns the accepted tokens plus
        the target's next one (at most `remaining` tokens in all)."""
        k = max(0, min(self.num_draft, remaining - 1))
        drafts: list[mx.array] = []
        feed = [*self.draft_pending, self.pending]
        if k:
            y = mx.array(feed, mx.uint32)
            for i in range(k):
                logits = self.draft(y[None], cache=self.draft_cache)[:, -1, :]
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                context = self.history + _ints(drafts) if self.processors else []
                y = self._pick(logprobs, self.step + i, context)
                mx.async_eval(y)
                drafts.append(y)
        verify = mx.concatenate([mx.array([self.pending], mx.uint32), *drafts])
        logits = self.target(verify[None], cache=self.target_cache)[0, -(k + 1) :, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self._sampler is None and not self.processors:
            picked = mx.argmax(logprobs, axis=-1)
        else:
            context = self.history
            picks = []
            for i in range(k + 1):
                picks.append(self._pick(logprobs[i : i + 1], self.step + i, context))
                if i < k and self.processors:
                    context = context + _ints(drafts[i : i + 1])
            picked = mx.concatenate(picks)
        mx.eval(picked, *drafts)
        proposed = _ints(drafts)
        listed: Any = picked.tolist()
        targets: list[int] = [int(t) for t in listed]
        n = 0
        while n < k and targets[n] == proposed[n]:
            n += 1
        # Keep pending + the n agreed drafts in the target; the draft never fed its last
        # proposal, so it holds at most k - 1 of them.
        trim_prompt_cache(self.target_cache, k - n)
        if k:
            trim_prompt_cache(self.draft_cache, max(k - 1 - n, 0))
            self.draft_pending = proposed[-1:] if n == k else []
        else:
            self.draft_pending = feed  # the draft did not run: it still owes these
        out = targets[: n + 1]
        self.pending = out[-1]
        self.history += out
        self.step += n + 1
        self.drafted_total += k
        self.accepted_total += n
        return RoundResult(out, [logprobs[i] for i in range(n + 1)], k, n)


def feed_prompt(model: Any, cache: list[Any], tokens: list[int], step: int) -> None:
    """Runs tokens through a model into its cache, `step` at a time (no logits kept)."""
    for start in range(0, len(tokens), step):
        model(mx.array(tokens[start : start + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def _ints(arrays: list[mx.array]) -> list[int]:
    values: list[Any] = [a.item() for a in arrays]
    return [int(v) for v in values]
