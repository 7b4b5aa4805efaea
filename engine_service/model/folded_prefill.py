"""The first token from the last prompt chunk's own forward pass.

mlx-lm's BatchGenerator prefills a prompt but its last token, then feeds that token as a decode
step of its own whose logits give the first token: before its first token a prompt costs its
chunks plus one more forward pass over the whole cache, and one more loop iteration. vLLM and
SGLang sample the first token from the prefill's own last position.

`FoldingBatchGenerator` does that: a row's last token rides in its last chunk, the chunk's
logits at the row's last position (computed there only: model/last_positions.py) become the
row's first step, and the decode step over the last token is skipped. mlx-lm's
`GenerationBatch` still runs that first step's sampling, logits processors (constraints,
penalties) and bookkeeping: it is given a model that answers its first call with those logits
(`_FirstStep`). So a folded row leaves the prompt batch in the state mlx-lm's own would after
its first step: the cache holds the whole prompt, the first token sampled, the row's token
list ending with the prompt's last token.

Whether a row folds depends on the row alone (its last chunk has room for the last token and
is short enough to gain: `fold_limit`), not on the rows beside it. Not for rows kept apart
(`keep_apart`: quantized-KV rows, whose last token attends over their quantized keys as in
mlx-lm), not at all for a model `LastPositions.probe` refuses, nor in deterministic mode, where
a prompt's last token is a step of its own by contract (checkpoints/prefix_reuse.py `aligned`).

A row's first token is also available as soon as it is sampled (`first_tokens`), before the
next `next()` launches the step after it: mlx-lm reports a token only from the call that
launches the following step, and on the CPU that launch runs much of the step itself (MLX's
evaluation waits once more than a few tasks are queued), so a first token waited a whole decode
step in the engine's loop (11 ms of a 36 ms turn at 4k cached positions of tandem-tiny).

Pinned to mlx-lm 0.32.2 like model/mlx_compat.py, and for the same reason it reads mlx-lm's
private names: `_next` is upstream's `BatchGenerator._next` with the fold added (marked);
tests/test_folded_prefill.py checks its tokens against mlx-lm's own generator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

from engine_service.model.last_positions import LastPositions

# The fold runs the model's last layer over every position of the last chunk (its logits are
# wanted at one); the step it saves runs the whole model over one position, which costs about a
# read of all its weights. On a GPU that read outweighs a layer over any prefill step's tokens
# (an H100's bf16 ridge: ~300 tokens a weight read), so every chunk folds. On the CPU the fold
# gains while the chunk has fewer tokens than FOLD_TOKENS_PER_LAYER_WEIGHTS times the model's
# weights counted in last layers (bench/folded_prefill_bench.py, docs/performance.md):
# tandem-tiny (4.9 layers' worth) crosses over at 32 tokens; the 0.6B shape (37.9: a 622 MB
# tied head) folds at a gain of 5% at 256 and within 4% either way at 1,024.
FOLD_TOKENS_PER_LAYER_WEIGHTS = 8


def fold_limit(model: Any) -> int | None:
    """The longest last chunk (its last token included) that folds for this model on the
    default device; None: any that fits a prefill step (a GPU, or a model whose layers are
    not listed)."""
    layers = getattr(model, "layers", None)
    if mx.default_device() != mx.cpu or not layers:
        return None
    last = weight_bytes(layers[-1])
    return max(1, round(FOLD_TOKENS_PER_LAYER_WEIGHTS * weight_bytes(model) / max(last, 1)))


def weight_bytes(module: Any) -> int:
    """The bytes of a module's parameters."""
    leaves: list[tuple[str, mx.array]] = tree_flatten(module.parameters())  # type: ignore[assignment]
    return sum(array.nbytes for _, array in leaves)


class _Folding:
    """The batch's model as the prompt batch calls it: on a folding step, its logits only at
    the folding rows' last positions, kept for `_fold`."""

    def __init__(self, model: Any, positions: LastPositions) -> None:
        self.model = model
        self.positions = positions
        self.rows: list[int] = []  # this step's folding rows and their last positions
        self.at: list[int] = []
        self.output: mx.array | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.rows:
            return self.model(*args, **kwargs)
        with self.positions.only(self.rows, self.at):
            self.output = self.model(*args, **kwargs)
        return self.output

    def take(self) -> mx.array | None:
        out, self.output, self.rows, self.at = self.output, None, [], []
        return out


class _FirstStep:
    """The model of a folded batch's first step: that step's logits, computed by the chunk."""

    def __init__(self, logits: mx.array) -> None:
        self.logits = logits

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        return self.logits


@dataclass(frozen=True)
class FirstToken:
    """A row's first token, sampled and evaluated, before the step that reports it."""

    uid: int
    token: int
    logprobs: mx.array  # the row's log-probabilities over the vocabulary, as reported


@dataclass(frozen=True)
class _Began:
    """Rows that began generating together: their first tokens and log-probabilities (one
    list per row), not evaluated yet."""

    uids: list[int]
    tokens: mx.array
    logprobs: list[mx.array]


class FoldingBatchGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator; a row's last prompt chunk gives its first token."""

    def __init__(
        self,
        model: Any,
        positions: LastPositions | None,
        fold_max_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        """positions: the model's `LastPositions` (None: no row folds; a model its probe
        refused, or deterministic mode). fold_max_tokens: the longest last chunk that folds
        (`fold_limit`; None: any that fits a prefill step); a longer one's last token is a
        step of its own, as in mlx-lm."""
        super().__init__(model, **kwargs)
        self.fold_max_tokens = fold_max_tokens or self.prefill_step_size
        self.folded_rows = 0  # rows whose first token came from their chunk (tests, stats)
        self._apart: set[int] = set()  # rows whose last token is a step of its own
        self._joined: list[_Began] = []  # rows that began generating in this next()
        self._folding_model = _Folding(self.model, positions) if positions else None
        if self._folding_model is not None:
            # The prompt batch lives as long as the generator (new rows extend it), and its
            # splits carry its model to their GenerationBatch's first step only.
            self._prompt_batch.model = self._folding_model

    def keep_apart(self, uids: list[int]) -> None:
        """These rows' last prompt token runs as a step of its own, as in mlx-lm: a quantized
        row's first token then attends over its quantized cache as mlx-lm's own
        QuantizedKVCache does (in the chunk it would attend over the plain keys)."""
        self._apart.update(uids)

    def first_tokens(self) -> list[FirstToken]:
        """The first tokens of the rows that began generating in the last `next()`, waited
        for now (a small graph: their chunk's last position, or their last token's step).
        The following `next()` reports each again, as mlx-lm does, with the same value."""
        joined, self._joined = self._joined, []
        if not joined:
            return []
        mx.eval([j.tokens for j in joined], [j.logprobs for j in joined])
        out = []
        for j in joined:
            tokens: list[int] = j.tokens.tolist()  # type: ignore[assignment]
            for uid, token, logprobs in zip(j.uids, tokens, j.logprobs, strict=True):
                out.append(FirstToken(uid, token, logprobs))
        return out

    def _began(self, batch: GenerationBatch) -> None:
        """Notes a batch of rows that began generating, before it joins the running batch
        (whose `extend` may take its lists as they are and grow them)."""
        self._joined.append(
            _Began(list(batch.uids), batch._next_tokens, list(batch._next_logprobs))
        )

    def remove(self, uids: Any, return_prompt_caches: bool = False) -> Any:
        self._apart.difference_update(uids)
        return super().remove(uids, return_prompt_caches)

    def _folding(self, chunks: list[int]) -> list[int]:
        """The rows (indices in _currently_processing) whose last token rides this step: those
        whose last chunk is this step's and has room for it."""
        if self._folding_model is None:
            return []
        uids = self._prompt_batch.uids
        return [
            i
            for i, seq in enumerate(self._currently_processing)
            if len(seq[0]) == 2
            and len(seq[0][1]) == 1
            and len(seq[0][0]) == chunks[i]
            and chunks[i] + 1 <= min(self.prefill_step_size, self.fold_max_tokens)
            and uids[i] not in self._apart
        ]

    def _fold(self, rows: list[int], prompts: list[list[int]], first: mx.array) -> None:
        """Rows whose chunk ended with their last token start generating from its logits
        (`first`: [rows, 1, vocab])."""
        last = [prompts[i][-1] for i in rows]
        done = set(rows)
        self._currently_processing = [
            s for i, s in enumerate(self._currently_processing) if i not in done
        ]
        batch = self._prompt_batch.split(rows)
        for tokens in batch.tokens:
            tokens.pop()  # prompt() counted the last token; the first step counts it (upstream)
        generation = GenerationBatch(
            _FirstStep(first),
            batch.uids,
            mx.array(last),
            batch.prompt_cache,
            batch.tokens,
            batch.samplers,
            batch.fallback_sampler,
            batch.logits_processors,
            batch.stop_sequences,
            batch.max_tokens,
        )
        generation.model = self.model
        self._began(generation)
        self._generation_batch.extend(generation)
        self.folded_rows += len(rows)

    def _next(self) -> tuple[list[Any], list[Any]]:  # noqa: C901  (upstream's, plus the fold)
        generation_responses: list[Any] = []
        prompt_responses: list[Any] = []
        self._joined = []

        if len(self._generation_batch) > 0:
            tic = time.perf_counter()
            generation_responses = self._generation_batch.next()
            self._counters.decode_time += time.perf_counter() - tic
            self._counters.generation_tokens += len(generation_responses)
            self._counters.generation_steps += 1
            if self._counters.generation_steps % 512 == 0:
                mx.clear_cache()

        if len(self._generation_batch) >= self.completion_batch_size:
            return prompt_responses, generation_responses

        n = min(
            self.prefill_batch_size - len(self._prompt_batch),
            self.completion_batch_size - len(self._generation_batch),
            len(self._unprocessed_sequences),
        )
        if n > 0:
            self._prompt_batch.extend(self._make_batch(n))

        # Rows left with only their last token start generating (upstream's path: a row whose
        # whole prompt is one token, or whose last chunk was too wide to fold).
        keep: list[int] = []
        split: list[int] = []
        for i, seq in enumerate(self._currently_processing):
            segments = seq[0]
            (split if len(segments) == 1 and len(segments[0]) == 1 else keep).append(i)
        if split:
            self._apart.difference_update(self._prompt_batch.uids[i] for i in split)
            last_inputs = [self._currently_processing[i][0][0] for i in split]
            progress = [(self._currently_processing[i][2],) * 2 for i in split]
            self._currently_processing = [self._currently_processing[i] for i in keep]
            gen_batch = self._prompt_batch.split(split).generate(last_inputs)
            self._began(gen_batch)
            for i, p in enumerate(progress):
                prompt_responses.append(
                    PromptProcessingBatch.Response(gen_batch.uids[i], p, True, True)
                )
            self._generation_batch.extend(gen_batch)

        chunks = [min(len(seq[0][0]), self.prefill_step_size) for seq in self._currently_processing]
        folding = self._folding(chunks)  # the fold: these rows' last token joins the chunk
        prompts = []
        for i, seq in enumerate(self._currently_processing):
            response = PromptProcessingBatch.Response(self._prompt_batch.uids[i], (), False, False)
            segments = seq[0]
            prompts.append(segments[0][: chunks[i]])
            segments[0] = segments[0][chunks[i] :]
            if len(segments[0]) == 0:
                segments.pop(0)
                response.end_of_segment = True
            if i in folding:
                prompts[-1] = prompts[-1] + segments.pop(0)
                response.end_of_prompt = True
            seq[1] += len(prompts[-1])
            response.progress = (seq[1], seq[2])
            prompt_responses.append(response)

        self._counters.prompt_tokens += sum(len(p) for p in prompts)
        tic = time.perf_counter()
        if folding:
            assert self._folding_model is not None
            self._folding_model.rows = folding
            self._folding_model.at = [len(prompts[i]) - 1 for i in folding]
        self._prompt_batch.prompt(prompts)
        first = self._folding_model.take() if self._folding_model is not None else None
        self._counters.prompt_time += time.perf_counter() - tic
        if folding:
            assert first is not None  # one model call: the chunk is at most a prefill step
            self._fold(folding, prompts, first)

        return prompt_responses, generation_responses
