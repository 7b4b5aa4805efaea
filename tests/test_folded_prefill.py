"""A prompt's last chunk gives its row's first token (model/folded_prefill.py): the same
tokens and log-probabilities as mlx-lm's own BatchGenerator, with one forward pass fewer and
the first token one step earlier. A last chunk without room for the last token, a model whose
logits cannot be taken at chosen positions (model/last_positions.py) and deterministic mode
keep mlx-lm's path."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.nn.layers.base import Module
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from engine_service.loop.jobs import Job, StartingPoint
from engine_service.loop.new_rows import NewRows
from engine_service.model.folded_prefill import (
    FOLD_TOKENS_PER_LAYER_WEIGHTS,
    FoldingBatchGenerator,
    fold_limit,
    weight_bytes,
)
from engine_service.model.last_positions import LastPositions
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.requests import GenerationRequest
from engine_service.protocol.sampling_options import SamplingOptions


@pytest.fixture(scope="module")
def tiny(engine_data_dir: Path) -> LoadedModel:
    return load_model("", engine_data_dir)


class CountingModel:
    """The model, counting its forward passes."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.model(*args, **kwargs)


@dataclass
class Run:
    tokens: list[list[int]]
    first_logprobs: list[np.ndarray[Any, Any]]
    steps_to_first: int  # next() calls until the first row's first token
    forwards_to_first: int  # forward passes until then
    folded: int
    # The folding generator's first tokens, as `first_tokens()` gave them after a next():
    # per row, the token, its log-probabilities and how many next() calls had run.
    ahead: list[tuple[int, np.ndarray[Any, Any], int]]


def _prompt(i: int, length: int) -> list[int]:
    return [(11 * i + 5 * j) % 700 + 3 for j in range(length)]


def _run(
    tiny: LoadedModel,
    fold: bool,
    lengths: list[int],
    tokens: int = 6,
    sampling: SamplingOptions | None = None,
    prefix: int = 0,
    positions: bool = True,
    prefill_step: int = 2048,
    fold_max: int | None = None,
) -> Run:
    """Rows of these prompt lengths decoded together, each after `prefix` tokens already in
    its cache (a store hit's shape), by mlx-lm's generator or the folding one."""
    model = CountingModel(tiny.model)
    kwargs: dict[str, Any] = dict(
        completion_batch_size=8, prefill_batch_size=8, prefill_step_size=prefill_step
    )
    bg = (
        FoldingBatchGenerator(
            model, LastPositions.probe(model) if positions else None, fold_max, **kwargs
        )
        if fold
        else BatchGenerator(model, **kwargs)
    )
    model.calls = 0  # not the probe's
    rows = NewRows(tiny.model)
    for i, length in enumerate(lengths):
        prompt = _prompt(i, prefix + length)
        caches = None
        if prefix:
            caches = make_prompt_cache(tiny.model)
            tiny.model(mx.array(prompt[:prefix])[None], cache=caches)
            mx.eval([c.state for c in caches])
        request = GenerationRequest(f"r{i}", prompt, tokens, sampling or SamplingOptions(), "")
        start = StartingPoint(prompt[prefix:], prompt[:prefix], caches, prefix)
        rows.add(Job(request, lambda events: None), start)
    rows.insert(bg)
    out: dict[int, list[int]] = {job.uid: [] for job in rows.jobs}
    first: dict[int, np.ndarray[Any, Any]] = {}
    ahead: dict[int, tuple[int, np.ndarray[Any, Any], int]] = {}
    left, steps, to_first, forwards = set(out), 0, 0, 0
    while left:
        _, responses = bg.next()
        steps += 1
        if isinstance(bg, FoldingBatchGenerator):
            for f in bg.first_tokens():
                assert f.uid not in ahead, "a row's first token is given once"
                ahead[f.uid] = (f.token, np.array(f.logprobs), steps)
        for r in responses:
            if not out[r.uid]:
                first[r.uid] = np.array(r.logprobs)
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                left.discard(r.uid)
        if responses and not to_first:
            to_first, forwards = steps, model.calls
    bg.close()
    uids = [job.uid for job in rows.jobs]
    return Run(
        [out[u] for u in uids],
        [first[u] for u in uids],
        to_first,
        forwards,
        getattr(bg, "folded_rows", 0),
        [ahead[u] for u in uids] if ahead else [],
    )


def _same(a: Run, b: Run) -> None:
    assert a.tokens == b.tokens
    for x, y in zip(a.first_logprobs, b.first_logprobs, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-4)


def _ahead_as_reported(run: Run) -> list[int]:
    """Each row's first token from `first_tokens()` is the one the next next() reports, with
    the same log-probabilities (bit for bit: one array); returns the next() calls after
    which each was given."""
    assert len(run.ahead) == len(run.tokens)
    for (token, logprobs, _), tokens, reported in zip(
        run.ahead, run.tokens, run.first_logprobs, strict=True
    ):
        assert token == tokens[0]
        np.testing.assert_array_equal(logprobs, reported)
    return [steps for _, _, steps in run.ahead]


def test_a_turn_after_a_cached_prefix_gets_its_first_token_from_its_chunk(
    tiny: LoadedModel,
) -> None:
    upstream = _run(tiny, False, [16], prefix=300)
    folded = _run(tiny, True, [16], prefix=300)
    _same(upstream, folded)
    assert folded.folded == 1
    assert folded.steps_to_first == upstream.steps_to_first - 1
    assert folded.forwards_to_first == upstream.forwards_to_first - 1
    # ... and it is there one next() earlier still, before the step after it is launched.
    assert _ahead_as_reported(folded) == [folded.steps_to_first - 1]


def test_rows_of_different_lengths_fold_together_with_mlx_lms_tokens(tiny: LoadedModel) -> None:
    lengths = [5, 17, 30, 1, 9]  # right-padded in one chunk; the 1-token row has no chunk
    upstream = _run(tiny, False, lengths)
    folded = _run(tiny, True, lengths)
    _same(upstream, folded)
    assert folded.folded == 4
    _ahead_as_reported(folded)  # the 1-token row's too (mlx-lm's own last step)


def test_seeded_sampling_and_penalties_see_the_same_first_step(tiny: LoadedModel) -> None:
    sampling = SamplingOptions(temperature=0.9, top_p=0.95, seed=7, repetition_penalty=1.3)
    upstream = _run(tiny, False, [12, 20], tokens=10, sampling=sampling)
    folded = _run(tiny, True, [12, 20], tokens=10, sampling=sampling)
    _same(upstream, folded)
    assert folded.folded == 2
    _ahead_as_reported(folded)


def test_a_prompt_of_several_chunks_folds_its_last_one_only(tiny: LoadedModel) -> None:
    # 16-token steps: 40 tokens are chunks of 16, 16 and 7 + the last; 33 fill two steps, so
    # their last token has no room in the second and takes a step of its own.
    upstream = _run(tiny, False, [40, 33], prefill_step=16)
    folded = _run(tiny, True, [40, 33], prefill_step=16)
    _same(upstream, folded)
    assert folded.folded == 1
    _ahead_as_reported(folded)


def test_a_last_chunk_longer_than_the_fold_limit_keeps_mlx_lms_step(tiny: LoadedModel) -> None:
    """Past `fold_max_tokens` (the last token included) the fold would cost more than the step
    it saves (`fold_limit`): that row's last token is a step of its own; a shorter row beside
    it still folds."""
    lengths = [20, 8]
    upstream = _run(tiny, False, lengths)
    folded = _run(tiny, True, lengths, fold_max=8)
    _same(upstream, folded)
    assert folded.folded == 1
    _ahead_as_reported(folded)


def test_the_fold_limit_follows_the_weights_a_step_reads(tiny: LoadedModel) -> None:
    """On the CPU: 8 tokens for each last layer's worth of the model's weights (tandem-tiny:
    4.9, so 39 tokens); on a GPU, and for a model whose layers are not listed, any chunk."""
    weights, last = weight_bytes(tiny.model), weight_bytes(tiny.model.layers[-1])
    on_cpu = round(FOLD_TOKENS_PER_LAYER_WEIGHTS * weights / last)
    assert 32 <= on_cpu <= 48  # where tandem-tiny's crossover was measured
    assert fold_limit(tiny.model) == (on_cpu if mx.default_device() == mx.cpu else None)
    assert fold_limit(object()) is None


def test_without_positions_nothing_folds(tiny: LoadedModel) -> None:
    off = _run(tiny, True, [16], prefix=64, positions=False)
    assert off.folded == 0
    _same(_run(tiny, False, [16], prefix=64), off)


class _MixingHead(Module):
    """A model whose logits at a position depend on the positions before it after its body
    (a running sum): taking the body's last position alone changes them."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.model = inner.model
        self.inner = inner

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        out = mx.cumsum(self.model(inputs, cache), axis=1)
        logits: mx.array = self.model.embed_tokens.as_linear(out)
        return logits

    @property
    def layers(self) -> Any:
        return self.inner.layers


def test_the_probe_takes_the_model_and_refuses_a_head_that_mixes_positions(
    tiny: LoadedModel,
) -> None:
    assert LastPositions.probe(tiny.model) is not None
    assert LastPositions.probe(_MixingHead(tiny.model)) is None
    assert LastPositions.probe(object()) is None


def test_rows_beginning_together_after_the_batch_emptied_get_their_own_first_tokens(
    tiny: LoadedModel,
) -> None:
    """After the running batch emptied, the first batch to join it lends it its lists, which
    the next one joining in the same step grows: each row's first token is still its own."""
    bg = FoldingBatchGenerator(
        tiny.model,
        LastPositions.probe(tiny.model),
        completion_batch_size=8,
        prefill_batch_size=8,
        prefill_step_size=2048,
    )
    (first,) = bg.insert([_prompt(0, 12)], max_tokens=[2])
    finished = False
    while not finished:
        _, responses = bg.next()
        finished = any(r.finish_reason is not None for r in responses)
    bg.first_tokens()
    one, folded = bg.insert([_prompt(1, 1), _prompt(2, 20)], max_tokens=[3, 3])
    bg.next()
    ahead = {f.uid: f for f in bg.first_tokens()}
    assert set(ahead) == {one, folded}
    reported: dict[int, Any] = {}
    while len(reported) < 2:
        for r in bg.next()[1]:
            reported.setdefault(r.uid, r)
    for uid, f in ahead.items():
        assert f.token == reported[uid].token
        np.testing.assert_array_equal(np.array(f.logprobs), np.array(reported[uid].logprobs))
    bg.close()
    assert first not in ahead
