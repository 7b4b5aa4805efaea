"""mlx-lm defects fixed in our adapter, each with why, and a test that fails when mlx-lm fixes
them (tests/test_upstream_fixes.py): when it does, drop the fix here.

`apply(model)` runs once after load. Each fix replaces one method of one mlx-lm class with a
corrected copy, and only for the architecture just loaded; solo (unpadded) paths stay
bit-identical. `Fix.upstream()` gives mlx-lm's own method back, for that test.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.ssm import ssm_update

__all__ = ["FIXES", "Fix", "apply"]


@dataclass(frozen=True)
class Fix:
    """mlx-lm's `module.cls.method` replaced by `replacement`, for the reason in `why`."""

    name: str
    module: str
    cls: str
    method: str
    replacement: Callable[..., Any]
    why: str

    def target(self) -> type:
        target: type = getattr(importlib.import_module(self.module), self.cls)
        return target

    def applied(self) -> bool:
        return vars(self.target()).get(self.method) is self.replacement

    def upstream(self) -> Callable[..., Any]:
        """mlx-lm's own method, whether or not the fix is installed."""
        if self.applied():
            return _UPSTREAM[self.name]
        method: Callable[..., Any] = vars(self.target())[self.method]
        return method

    def install(self) -> None:
        if not self.applied():
            _UPSTREAM[self.name] = self.upstream()
            setattr(self.target(), self.method, self.replacement)


_UPSTREAM: dict[str, Callable[..., Any]] = {}


def _mamba2_ssm(
    self: Any,
    hidden_states: mx.array,
    B: mx.array,
    C: mx.array,
    dt: mx.array,
    cache: Any,
    mask: mx.array | None,
) -> mx.array:
    """NemotronHMamba2Mixer._ssm as granitemoehybrid / mamba2 / falcon_h1 write it: the
    cache's `lengths` go to `ssm_update` (the only change)."""
    batch, seq_len, _ = hidden_states.shape
    x = hidden_states.reshape(batch, seq_len, self.num_heads, self.head_dim)
    B = B.reshape(batch, seq_len, self.n_groups, self.ssm_state_size)
    C = C.reshape(batch, seq_len, self.n_groups, self.ssm_state_size)
    # `if cache:` as upstream writes it, so the unbatched path is the very same computation.
    state, lengths = (cache[1], cache.lengths) if cache else (None, None)
    y, state = ssm_update(
        x,
        self.A_log,
        B,
        C,
        self.D.astype(x.dtype),
        dt,
        self.dt_bias,
        state,
        self.time_step_limit,
        mask,
        lengths,
    )
    if cache:
        cache[1] = state
    out: mx.array = y.reshape(batch, seq_len, self.intermediate_size)
    return out


FIXES: tuple[Fix, ...] = (
    Fix(
        name="nemotron_h-ssm-lengths",
        module="mlx_lm.models.nemotron_h",
        cls="NemotronHMamba2Mixer",
        method="_ssm",
        replacement=_mamba2_ssm,
        why=(
            "BatchGenerator right-pads a batch's shorter prompts and sets ArraysCache.lengths. "
            "nemotron_h's _conv keeps each row's conv state at its own length, but _ssm does not "
            "pass `lengths` to ssm_update, so the scan's state is taken at the batch's last "
            "position: for a padded row that is padding, masked out, so the state holds none of "
            "its prompt and the row decodes differently from the same request alone (mlx-lm's "
            "batch_generate too). Passing `lengths`, as the other Mamba2 models do, takes the "
            "state at each row's last real token."
        ),
    ),
)


def apply(model: Any) -> None:
    """Installs the fixes for the loaded model's architecture (idempotent; no-op for others)."""
    for fix in FIXES:
        if type(model).__module__ == fix.module:
            fix.install()
