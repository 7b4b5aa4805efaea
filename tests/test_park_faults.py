"""A row asked to leave the batch (its turn is over, or its client stopped reading) whose
capture raises keeps its slot and runs on: the engine loop goes on, nothing is lost.

In-process, on the tiny model: two slots, four requests, turns of 8 tokens, and the first
captures raising MLX-CUDA's allocation failure (what an H100 raised when 8 rows of 8k
prompts ran it out of memory; loop/memory_pressure.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_service.checkpoints import cache_records
from engine_service.loop import preemption
from engine_service.loop.limits import Limits
from engine_service.loop.preemption import ParkSettings
from engine_service.loop.scheduler import Scheduler
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from tests.generation_rows import ended_as, greedy, submit_all

CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"
TOKENS = 40
FAILING_CAPTURES = 2


@pytest.fixture(scope="module")
def tiny(engine_data_dir: Path) -> LoadedModel:
    return load_model("", engine_data_dir)


def test_a_row_whose_capture_runs_out_of_memory_keeps_its_slot(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = cache_records.capture
    raised = {"n": 0}

    def capture(*args: Any, **kwargs: Any) -> Any:
        if raised["n"] < FAILING_CAPTURES:
            raised["n"] += 1
            raise RuntimeError(CUDA_OOM)
        return real(*args, **kwargs)

    monkeypatch.setattr(preemption, "capture", capture)  # the name parking calls
    prompts = [list(range(30 + 4 * i, 60 + 2 * i)) for i in range(4)]
    expected = [greedy(tiny, prompt, TOKENS) for prompt in prompts]  # before the MLX thread
    limits = Limits(max_running=2, max_queued=8, park=ParkSettings(turn_tokens=8))
    scheduler = Scheduler(tiny, limits)
    scheduler.start()
    try:
        ended_as(expected, submit_all(scheduler, tiny, "turns", prompts, TOKENS), 120.0)
        assert raised["n"] == FAILING_CAPTURES
        parking = scheduler.stats().parking
        # Rows, not calls: a failed call held every row asked to leave on its step (of 2).
        assert FAILING_CAPTURES <= parking.capture_failed_total <= 2 * FAILING_CAPTURES
        assert parking.turns_yielded_total >= 1  # later captures went through: turns taken
        assert parking.parked == 0 and parking.parked_bytes == 0
    finally:
        scheduler.shutdown()
