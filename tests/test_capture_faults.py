"""A generation snapshot that cannot be taken (here: MLX-CUDA's allocation failure, injected
where the device allocates: the round's copy out of the batch after its segments were
planned, the staging of a round, the prompt's prefix record beside the first snapshot) is
lost, not the engine loop's end (before, the exception left the MLX thread and the core exited
under every running request): the row goes on with the tokens of an uninterrupted run, the
loss is counted as a failed save, and the chain starts over at its next snapshot instead of
building on the hole, so the kept generation resumes exactly
(checkpoints/generations.py `lost`). A real in-process store and the embedded model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from engine_service.checkpoints.generations import GenerationCheckpoints
from engine_service.checkpoints.manager import CheckpointManager, CheckpointSettings
from engine_service.kv.batch_cache import BatchQuantizedKVCache
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from tests.generation_rows import continues_exactly, kept_generation

CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"
PROMPT = [(j * 31) % 500 + 5 for j in range(40)]


@pytest.fixture(scope="module")
def tiny(engine_data_dir: Path) -> LoadedModel:
    return load_model("", engine_data_dir)


def _failing(real: Callable[..., Any], times: int, left: dict[str, int], name: str) -> Any:
    """real, raising MLX-CUDA's allocation failure on its first `times` calls."""
    left[name] = times

    def call(*args: Any, **kwargs: Any) -> Any:
        if left[name]:
            left[name] -= 1
            raise RuntimeError(CUDA_OOM)
        return real(*args, **kwargs)

    return call


@pytest.mark.parametrize("where", ["round-copy", "round-staging", "prefix-record"])
def test_a_snapshot_lost_to_the_device_leaves_a_generation_that_resumes_exactly(
    tiny: LoadedModel, inprocess_store: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    checkpoints = CheckpointManager(tiny, CheckpointSettings(store=inprocess_store))
    left: dict[str, int] = {}
    if where == "round-copy":  # after next_segment advanced the chains: the hole's case
        real = BatchQuantizedKVCache.plain_columns
        monkeypatch.setattr(BatchQuantizedKVCache, "plain_columns", _failing(real, 2, left, where))
    elif where == "round-staging":  # the round's copies evaluated and pushed
        staged = GenerationCheckpoints._staged
        monkeypatch.setattr(GenerationCheckpoints, "_staged", _failing(staged, 1, left, where))
    else:  # the prompt's record, saved beside the first snapshot (cut, not yet queued)
        saves = checkpoints.prefixes.saves
        monkeypatch.setattr(saves, "save", _failing(saves.save, 1, left, where))
    try:
        emitted: list[int] = []
        request, key = kept_generation(
            tiny, checkpoints, PROMPT, tokens=56, rid=where, planned=False, emitted=emitted
        )
        assert left[where] == 0  # every injected failure was met
        expected = generate_step(mx.array(PROMPT), tiny.model, max_tokens=len(emitted))
        assert emitted == [int(t) for t, _ in expected]
        assert checkpoints.counters.snapshot().failed >= 1
        gens = checkpoints.generations
        plan = gens.loads.load(key, "default", request.prompt, request.layout)
        assert len(plan.generated) >= 16  # rounds after the loss were taken
        continues_exactly(tiny, gens, plan, PROMPT)
    finally:
        checkpoints.close()
