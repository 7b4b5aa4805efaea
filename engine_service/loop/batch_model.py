"""The model the engine's batch calls, before structured output's masks wrap it."""

from __future__ import annotations

from typing import Any

from engine_service.loop.compiled_decode import CompiledDecode
from engine_service.model.deterministic import DeterministicModel


def batch_model(
    model: Any,
    compiled_decode_max_batch: int = 0,
    deterministic_rows: int | None = None,
    deterministic_kernel: bool = False,
    deterministic_rows_alone: bool | None = None,
) -> Any:
    """Batch-invariant rows (model/deterministic.py; deterministic_rows None: off), decode
    steps of small batches compiled (loop/compiled_decode.py; not a deterministic model whose
    rows attend alone: it steps eagerly), or the model as loaded."""
    if deterministic_rows is not None:
        model = DeterministicModel(
            model, deterministic_rows, deterministic_kernel, deterministic_rows_alone
        )
    if compiled_decode_max_batch > 0 and getattr(model, "compiles", True):
        model = CompiledDecode(model, compiled_decode_max_batch)
    return model
