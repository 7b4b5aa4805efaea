"""What the engine loop tells a request's handler: Started, Token per generated token, and
exactly one Finished. Shared by the batch loop (scheduler.py) and the speculative lane."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

# "stop": a stop token (stop strings are found by the handler); "deadline": the client's
# deadline passed; "idle": the client read nothing for the park timeout (preemption.py).
FinishReason = Literal["length", "stop", "cancelled", "deadline", "idle", "error"]


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class Token:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    error: str = ""
    stop_token: int | None = None
    drafted: int = 0  # speculative decoding: draft tokens proposed and kept
    accepted: int = 0


Event = Started | Token | Finished
Sink = Callable[[list[Event]], None]
