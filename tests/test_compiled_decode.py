"""The compiled decode step gives the eager step's tokens, and steps aside where it cannot
compile (quantized rows, prefill) without changing a token."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from engine_service.loop.compiled_decode import CompiledDecode
from engine_service.loop.jobs import Job, StartingPoint
from engine_service.loop.new_rows import NewRows
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.kv_codec import PLAIN_KV, KVCodec
from engine_service.protocol.requests import GenerationRequest
from engine_service.protocol.sampling_options import SamplingOptions


@pytest.fixture(scope="module")
def tiny(engine_data_dir: Path) -> LoadedModel:
    return load_model("", engine_data_dir)


def _generate(
    model: object,
    tiny: LoadedModel,
    lengths: list[int],
    tokens: int,
    kv: KVCodec = PLAIN_KV,
    sampling: SamplingOptions | None = None,
) -> list[list[int]]:
    """Greedy (or seeded) tokens of prompts of these lengths, decoded together."""
    bg = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    rows = NewRows(tiny.model)
    for i, length in enumerate(lengths):
        prompt = [(7 * i + 3 * j) % 500 + 3 for j in range(length)]
        options = sampling or SamplingOptions()
        request = GenerationRequest(f"r{i}", prompt, tokens, options, "", kv=kv)
        rows.add(Job(request, lambda events: None), StartingPoint(prompt, [], None, 0))
    rows.insert(bg)
    out: dict[int, list[int]] = {job.uid: [] for job in rows.jobs}
    left = set(out)
    while left:
        _, responses = bg.next()
        for r in responses:
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                left.discard(r.uid)
    bg.close()
    return [out[job.uid] for job in rows.jobs]


def test_compiled_steps_give_the_eager_tokens_across_padding_and_growth(
    tiny: LoadedModel,
) -> None:
    compiled = CompiledDecode(tiny.model)
    # Left padding differs per row; the 233-token prompt's row crosses the 256-column capacity
    # step after 23 tokens, so a growth step falls among the 40.
    lengths = [5, 17, 233]
    eager = _generate(tiny.model, tiny, lengths, 40)
    assert _generate(compiled, tiny, lengths, 40) == eager
    # Compiled: every step but the growth step (40 without it: a prompt of 200 tokens).
    assert 30 < compiled.compiled_steps < 40
    # Another batch size retraces and still agrees.
    assert _generate(compiled, tiny, [9, 2], 20) == _generate(tiny.model, tiny, [9, 2], 20)


def test_seeded_sampling_agrees_too(tiny: LoadedModel) -> None:
    sampled = SamplingOptions(temperature=0.8, seed=11)
    compiled = CompiledDecode(tiny.model)
    eager = _generate(tiny.model, tiny, [6, 12], 40, sampling=sampled)
    assert _generate(compiled, tiny, [6, 12], 40, sampling=sampled) == eager


def test_quantized_rows_decode_eagerly(tiny: LoadedModel) -> None:
    q8 = KVCodec(bits=8, group_size=32, start=0)
    compiled = CompiledDecode(tiny.model)
    eager = _generate(tiny.model, tiny, [8, 20], 30, kv=q8)
    assert _generate(compiled, tiny, [8, 20], 30, kv=q8) == eager
    assert compiled.compiled_steps == 0


def test_batches_past_the_bound_decode_eagerly(tiny: LoadedModel) -> None:
    compiled = CompiledDecode(tiny.model, max_batch=2)
    eager = _generate(tiny.model, tiny, [5, 9, 3], 16)
    assert _generate(compiled, tiny, [5, 9, 3], 16) == eager
    assert compiled.compiled_steps == 0
    assert _generate(compiled, tiny, [5, 9], 16) == _generate(tiny.model, tiny, [5, 9], 16)
    assert compiled.compiled_steps > 10


def test_a_step_mlx_cannot_run_turns_the_compiled_path_off(tiny: LoadedModel) -> None:
    compiled = CompiledDecode(tiny.model)

    def unsupported(
        inputs: mx.array, column: mx.array, width: mx.array, *flat: mx.array
    ) -> list[mx.array]:
        raise RuntimeError("no kernel for this primitive on this device")

    compiled._step = unsupported  # what a backend without an op would raise
    eager = _generate(tiny.model, tiny, [7, 11], 12)
    assert _generate(compiled, tiny, [7, 11], 12) == eager
    assert not compiled.enabled and compiled.compiled_steps == 0


def test_a_step_that_runs_the_device_out_of_memory_keeps_the_compiled_path(
    tiny: LoadedModel,
) -> None:
    """Out of memory is the device's state, not a graph MLX cannot run: the step fails (the
    scheduler's failure handling runs its rows again, fewer at a time) and later steps
    compile again."""
    compiled = CompiledDecode(tiny.model)
    real, raised = compiled._step, [0]

    def crowded(
        inputs: mx.array, column: mx.array, width: mx.array, *flat: mx.array
    ) -> list[mx.array]:
        if not raised[0]:
            raised[0] += 1
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return real(inputs, column, width, *flat)

    compiled._step = crowded
    with pytest.raises(RuntimeError, match="out of memory"):
        _generate(compiled, tiny, [7, 11], 12)
    assert compiled.enabled
    assert _generate(compiled, tiny, [7, 11], 12) == _generate(tiny.model, tiny, [7, 11], 12)
    assert compiled.compiled_steps > 0
