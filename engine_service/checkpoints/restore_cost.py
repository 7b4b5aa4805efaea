"""Restore or recompute: whether a stored prefix is cheaper to load than to prefill.

A store hit pays a round trip and its bytes (restore bandwidth); a prefill pays its tokens
(prefill rate). Both rates are measured online from the engine's own restores and prefills
(exponential moving averages); until both are known, a hit is restored. A hit whose predicted
restore time exceeds the predicted prefill of the same tokens is skipped (prefilled), and
Stats reports the choices and the two rates. On a CPU a restore is far cheaper; on a fast GPU
with a slow store the opposite was measured (docs/performance.md), which is why it is decided
per request and not assumed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# Weight of a new measurement in the moving averages.
EMA = 0.3
# What a store hit costs beyond its bytes: the lookup and the header round trip.
FIXED_S = 0.003
# After this many prefills chosen in a row, one hit is restored anyway: the restore rate is
# measured again (a first restore slowed by warm-up, or a store that got faster, is not
# trusted forever).
PROBE_EVERY = 16


@dataclass(frozen=True)
class Prediction:
    restore_s: float
    prefill_s: float


@dataclass(frozen=True)
class CostSnapshot:
    restore_bytes_per_second: float
    prefill_tokens_per_second: float
    restore_chosen: int
    prefill_chosen: int


class RestoreCost:
    def __init__(self, fixed_s: float = FIXED_S) -> None:
        self.fixed_s = fixed_s
        self._lock = threading.Lock()
        self._restore_bps = 0.0
        self._prefill_tps = 0.0
        self._bytes_per_token = 0.0
        self._restore_chosen = 0
        self._prefill_chosen = 0
        self._prefill_streak = 0  # prefills chosen since the last restore

    def observe_restore(self, nbytes: int, tokens: int, seconds: float) -> None:
        if nbytes <= 0 or tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self._restore_bps = _ema(self._restore_bps, nbytes / max(seconds - self.fixed_s, 1e-6))
            self._bytes_per_token = _ema(self._bytes_per_token, nbytes / tokens)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self._prefill_tps = _ema(self._prefill_tps, tokens / seconds)

    def predicted(self, tokens: int) -> Prediction | None:
        """The two predicted times for `tokens` positions; None until both rates are known."""
        with self._lock:
            return self._predicted(tokens)

    def _predicted(self, tokens: int) -> Prediction | None:
        if not (self._restore_bps and self._prefill_tps and self._bytes_per_token):
            return None
        return Prediction(
            self.fixed_s + tokens * self._bytes_per_token / self._restore_bps,
            tokens / self._prefill_tps,
        )

    def worth_restoring(self, tokens: int) -> bool:
        """Whether loading `tokens` stored positions beats prefilling them (counted)."""
        with self._lock:
            prediction = self._predicted(tokens)
            choose = prediction is None or prediction.restore_s <= prediction.prefill_s
            if not choose:
                self._prefill_streak += 1
                if self._prefill_streak >= PROBE_EVERY:
                    choose = True  # a probe: measure the restore rate again
            if choose:
                self._prefill_streak = 0
                self._restore_chosen += 1
            else:
                self._prefill_chosen += 1
            return bool(choose)

    def snapshot(self) -> CostSnapshot:
        with self._lock:
            return CostSnapshot(
                self._restore_bps, self._prefill_tps, self._restore_chosen, self._prefill_chosen
            )


def _ema(old: float, new: float) -> float:
    return new if not old else (1 - EMA) * old + EMA * new
