"""A row the model fails on mid-stream ends alone; the rows batched with it go on exactly. A step
that runs the device out of memory is the batch's: its rows run again, fewer at a time, and a
row that runs it out of memory alone ends RESOURCE_EXHAUSTED, not INTERNAL.

In-process, on the tiny model whose attention is made to fail on affine-quantized rows past
a length the start-up probe's short rows never reach (a failure nobody knew of: the probe
refuses the ones it finds): the failing row joins plain rows, converts to 8 bits after 29
tokens, and from then on every step of its batch raises.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from engine_service.device_memory import is_out_of_memory
from engine_service.errors import Corrupt, ModelFailed, Overloaded
from engine_service.front.response_stream import RequestStream, respond
from engine_service.kv.batch_cache import BatchQuantizedKVCache
from engine_service.loop.limits import Limits
from engine_service.loop.memory_pressure import RELAX_STEPS
from engine_service.loop.scheduler import Scheduler
from engine_service.model.folded_prefill import FoldingBatchGenerator
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.events import Finished, Started, Token
from engine_service.protocol.kv_codec import KVCodec, StorageKind
from tests.generation_rows import Collector, ended_as, greedy, request_for, submit_all

LONG = 96  # the plain streams' length (the failing row ends after ~25 steps)
QUANTIZED_FROM = 29
FAILS_PAST = 20
# What MLX-CUDA raised on an H100 when 8 rows of 8,192-token prompts ran it out of memory.
CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"


class FailsOnAffineRows:
    """The model, with an attention that raises once a batch holds an affine-quantized row
    and more than FAILS_PAST columns (the probe's rows stay shorter)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.raised = 0

    def __getattr__(self, name: str) -> Any:  # layers, make_cache, args...: the model's
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> Any:
        for layer in cache or []:
            if (
                isinstance(layer, BatchQuantizedKVCache)
                and layer.size() > FAILS_PAST
                and any(
                    layer.row_storage(i).kind is StorageKind.AFFINE for i in range(inputs.shape[0])
                )
            ):
                self.raised += 1
                raise ValueError("Quantized SDPA does not support attention sinks.")
        return self.model(inputs, cache=cache, **kwargs)


@pytest.fixture(scope="module")
def tiny(engine_data_dir: Path) -> LoadedModel:
    return load_model("", engine_data_dir)


def test_plain_streams_batched_with_a_failing_row_complete(tiny: LoadedModel) -> None:
    failing = FailsOnAffineRows(tiny.model)
    loaded = LoadedModel(**{**tiny.__dict__, "model": failing})
    prompts = [list(range(10 + 7 * i, 40 + 9 * i)) for i in range(3)]
    expected = [greedy(tiny, prompt, LONG) for prompt in prompts]  # before the MLX thread runs
    scheduler = Scheduler(loaded, Limits(max_running=8, max_queued=8))
    scheduler.start()
    try:
        plain = [Collector() for _ in prompts]
        for i, (prompt, sink) in enumerate(zip(prompts, plain, strict=True)):
            scheduler.submit(request_for(loaded, f"plain-{i}", prompt, LONG, KVCodec()), sink)
        culprit = Collector()
        quantized = KVCodec(8, 64, QUANTIZED_FROM)
        short = [5, 6, 7, 8, 9]
        scheduler.submit(request_for(loaded, "eight-bit", short, 100, quantized), culprit)

        end = culprit.wait(120.0)
        assert end.reason == "error" and end.failure == "ModelFailed"
        assert "attention sinks" in end.error
        # It ran until its row converted, then failed alone.
        assert QUANTIZED_FROM - len(short) - 1 <= len(culprit.tokens) < 100
        for want, sink in zip(expected, plain, strict=True):
            assert sink.wait(120.0).reason == "length"
            assert sum(isinstance(e, Started) for e in sink.events) == 1
            assert sink.tokens == want
        assert failing.raised >= 2  # in the batch, then in its trial alone
        assert loaded.capabilities.affine_kv == ""  # the probe's short rows ran
        assert scheduler.stats().isolated_failures_total == 1
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize(
    "failure,kind",
    [
        ("ModelFailed", ModelFailed),
        ("Corrupt", Corrupt),
        ("", ModelFailed),
        ("Overloaded", Overloaded),
    ],
)
def test_a_row_that_failed_in_the_engine_ends_its_stream_with_a_status(
    tiny: LoadedModel, failure: str, kind: type[Exception]
) -> None:
    """Not OK with finish_reason error and the tokens so far: the status of the failure."""

    async def read() -> list[int]:
        events = RequestStream()
        events.push([Started(5, 0), Token(7)])
        events.push([Finished("error", error="the model failed", failure=failure)])
        request = request_for(tiny, "r", [1, 2, 3, 4, 5], 8, KVCodec())
        got: list[int] = []
        async for chunk in respond(request, tiny.tokenizer, events, 0.0, [], lambda: None):
            got += chunk.token_ids
        return got

    with pytest.raises(kind, match="the model failed"):
        asyncio.run(read())


class FailsOnLongBatches:
    """The model, raising on every decode step over a batch longer than `past` positions:
    a long prompt's row fails alone, short ones only beside it."""

    def __init__(self, model: Any, past: int, failure: Exception | None = None) -> None:
        self.model = model
        self.past = past
        self.failure = failure or ValueError("the long row's decode step")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> Any:
        if inputs.shape[1] == 1 and cache and cache[0].size() > self.past:
            raise self.failure
        return self.model(inputs, cache=cache, **kwargs)


@pytest.mark.parametrize(
    ("failure", "status"),
    [
        (ValueError("the long row's decode step"), "ModelFailed"),
        (RuntimeError(CUDA_OOM), "Overloaded"),  # out of memory alone: RESOURCE_EXHAUSTED
    ],
)
def test_a_first_token_already_sent_is_kept_when_the_next_step_fails(
    tiny: LoadedModel, failure: Exception, status: str
) -> None:
    """Both rows' first tokens leave before their first decode step (loop/first_tokens.py
    `_send_first_tokens`); that step fails, and the short row starts again by recompute from
    the token its client already has: no token twice, none different. The long row fails
    alone and ends with its failure's status. (Prefill steps of 64 tokens: the long prompt's
    last chunk is short enough to fold on the CPU too, model/folded_prefill.py `fold_limit`.)"""
    model = FailsOnLongBatches(tiny.model, 150, failure)
    loaded = LoadedModel(**{**tiny.__dict__, "model": model})
    short, long = list(range(30, 60)), list(range(100, 300))
    expected = greedy(tiny, short, 12)
    scheduler = Scheduler(loaded, Limits(max_running=4, max_queued=4, prefill_step_size=64))
    scheduler.start()
    try:
        innocent, culprit = Collector(), Collector()
        scheduler.submit(request_for(loaded, "short", short, 12, KVCodec()), innocent)
        scheduler.submit(request_for(loaded, "long", long, 12, KVCodec()), culprit)
        end = culprit.wait(120.0)
        assert end.reason == "error" and end.failure == status
        assert len(culprit.tokens) == 1  # its first token, sent before the step failed
        assert innocent.wait(120.0).reason == "length"
        assert innocent.tokens == expected
        assert scheduler.stats().isolated_failures_total == 1
    finally:
        scheduler.shutdown()


class RunsOutOfMemoryPastRows:
    """The model, raising MLX-CUDA's allocation failure on any call over more than `rows` rows
    once armed (after the start-up probe): a device with room for `rows` rows at a time."""

    def __init__(self, model: Any, rows: int) -> None:
        self.model = model
        self.rows = rows
        self.armed = False
        self.raised = 0
        self.widest = 0  # the most rows a call ran with

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> Any:
        if self.armed and inputs.shape[0] > self.rows:
            self.raised += 1
            raise RuntimeError(CUDA_OOM)
        self.widest = max(self.widest, inputs.shape[0]) if self.armed else 0
        return self.model(inputs, cache=cache, **kwargs)


def test_rows_that_ran_the_device_out_of_memory_together_run_fewer_at_a_time(
    tiny: LoadedModel,
) -> None:
    """Five streams on a device with room for two rows: every stream completes with the tokens
    of its uninterrupted run (RELAX_STEPS is passed, so the ceiling rises into the failure
    again), none ends with an error."""
    crowded = RunsOutOfMemoryPastRows(tiny.model, 2)
    loaded = LoadedModel(**{**tiny.__dict__, "model": crowded})
    length = RELAX_STEPS + 40
    prompts = [list(range(20 + 5 * i, 50 + 3 * i)) for i in range(5)]
    expected = [greedy(tiny, prompt, length) for prompt in prompts]
    scheduler = Scheduler(loaded, Limits(max_running=8, max_queued=8))
    scheduler.start()
    crowded.armed = True
    try:
        ended_as(expected, submit_all(scheduler, loaded, "crowded", prompts, length), 300.0)
        assert crowded.raised >= 2  # the first batch, and again once the ceiling rose
        assert crowded.widest <= 2
        stats = scheduler.stats()
        assert stats.isolated_failures_total == 0  # no request failed
        assert stats.out_of_memory_steps_total == crowded.raised
        assert 1 <= stats.row_ceiling < 8  # lowered, not yet back up to --max-running
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize(
    "failure,expected",
    [
        (RuntimeError(CUDA_OOM), True),
        (RuntimeError("[metal::malloc] Attempting to allocate 40000000000 bytes"), True),
        (RuntimeError("[METAL] Command buffer execution failed: Insufficient Memory"), True),
        (MemoryError(), True),
        (RuntimeError("std::bad_alloc"), True),
        (ValueError("Quantized SDPA does not support attention sinks."), False),
        (RuntimeError("[reshape] Cannot reshape array of size 6 into shape (4,)"), False),
    ],
)
def test_what_counts_as_the_device_running_out_of_memory(
    failure: Exception, expected: bool
) -> None:
    assert is_out_of_memory(failure) is expected


def test_a_speculative_row_out_of_memory_ends_resource_exhausted(
    tiny: LoadedModel, engine_data_dir: Path
) -> None:
    """Speculative rows run as a batch of their own (speculative/lane.py): a round or a
    prefill that runs the device out of memory ends its request RESOURCE_EXHAUSTED, not
    INTERNAL; a plain row beside it goes on exactly."""
    draft = load_model("tandem-tiny-draft", engine_data_dir)
    crowded = RunsOutOfMemoryPastRows(draft.model, 0)  # no room for the draft at all
    prompt = list(range(40, 70))
    expected = greedy(tiny, prompt, 16)
    scheduler = Scheduler(
        tiny,
        Limits(max_running=4, max_queued=4),
        draft=LoadedModel(**{**draft.__dict__, "model": crowded}),
    )
    scheduler.start()
    crowded.armed = True
    try:
        plain, speculative = Collector(), Collector()
        scheduler.submit(request_for(tiny, "plain", prompt, 16, KVCodec()), plain)
        request = dataclasses.replace(request_for(tiny, "drafted", prompt, 16), num_draft=3)
        scheduler.submit(request, speculative)
        end = speculative.wait(120.0)
        assert end.reason == "error" and end.failure == "Overloaded"
        assert "out of memory" in end.error
        assert crowded.raised >= 1
        assert plain.wait(120.0).reason == "length"
        assert plain.tokens == expected
    finally:
        scheduler.shutdown()


def test_first_tokens_whose_evaluation_runs_out_of_memory_are_a_failed_step(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first tokens are evaluated after the step that sampled them (a short graph, but
    the fold's last layer is in it): when that evaluation raises, the step failed, and its
    rows run again as any failed step's; none ends, every stream is exact."""
    real = FoldingBatchGenerator.first_tokens
    raised = {"n": 0}

    def first_tokens(self: FoldingBatchGenerator) -> Any:
        if self._joined and not raised["n"]:
            raised["n"] += 1
            self._joined = []  # what the generator had: the rows' first tokens, not evaluated
            raise RuntimeError(CUDA_OOM)
        return real(self)

    monkeypatch.setattr(FoldingBatchGenerator, "first_tokens", first_tokens)
    prompts = [list(range(30 + 3 * i, 50 + 2 * i)) for i in range(3)]
    expected = [greedy(tiny, prompt, 12) for prompt in prompts]
    scheduler = Scheduler(tiny, Limits(max_running=4, max_queued=4))
    scheduler.start()
    try:
        ended_as(expected, submit_all(scheduler, tiny, "first", prompts, 12), 120.0)
        assert raised["n"] == 1
        assert scheduler.stats().out_of_memory_steps_total == 1
    finally:
        scheduler.shutdown()


class AffineRowsRunOutOfMemory:
    """The model, raising MLX-CUDA's allocation failure on its first `times` calls over a
    batch holding an affine-quantized row (the KV codec's start-up probe's, here)."""

    def __init__(self, model: Any, times: int) -> None:
        self.model = model
        self.left = times

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> Any:
        affine = any(
            isinstance(layer, BatchQuantizedKVCache)
            and any(layer.row_storage(i).kind is StorageKind.AFFINE for i in range(inputs.shape[0]))
            for layer in cache or []
        )
        if affine and self.left:
            self.left -= 1
            raise RuntimeError(CUDA_OOM)
        return self.model(inputs, cache=cache, **kwargs)


def test_a_kv_probe_out_of_memory_refuses_the_request_not_the_codec(tiny: LoadedModel) -> None:
    """A quantized KV codec is probed at its first request; a probe that runs the device out
    of memory ends that request RESOURCE_EXHAUSTED and leaves the codec unprobed (it was
    recorded as the model's refusal for the engine's life): the next request probes again
    and runs."""
    model = AffineRowsRunOutOfMemory(tiny.model, 1)
    unprobed = dataclasses.replace(tiny.capabilities, affine_kv=None)
    loaded = LoadedModel(**{**tiny.__dict__, "model": model, "capabilities": unprobed})
    scheduler = Scheduler(loaded, Limits(max_running=4, max_queued=4))
    scheduler.start()
    try:
        eight_bits = KVCodec(8, 64)
        first, again = Collector(), Collector()
        scheduler.submit(request_for(loaded, "first", [5, 6, 7, 8, 9], 8, eight_bits), first)
        end = first.wait(120.0)
        assert end.reason == "error" and end.failure == "Overloaded", end.error
        assert "out of memory" in end.error
        assert loaded.capabilities.affine_kv is None
        scheduler.submit(request_for(loaded, "again", [5, 6, 7, 8, 9], 8, eight_bits), again)
        assert again.wait(120.0).reason == "length"
        assert len(again.tokens) == 8
        assert loaded.capabilities.affine_kv == ""
    finally:
        scheduler.shutdown()
