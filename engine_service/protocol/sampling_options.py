"""A request's sampling options as the front validated them (sampling/samplers.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_service.protocol.constraint import Constraint


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20  # for all three penalties
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by token id
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = -1  # -1: none; n >= 0: the sampled token's logprob and n alternatives
    ignore_eos: bool = False
    constraint: Constraint | None = None  # structured output (constraints.py)
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
