"""What other threads ask of the engine loop, through its inbox (loop/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass

from engine_service.core.plans import ResumePlan
from engine_service.loop.jobs import Job


@dataclass(frozen=True)
class Submit:
    job: Job


@dataclass(frozen=True)
class Cancel:
    request_id: str
    keep_checkpoint: bool
    stopped: bool  # a stop string ended the text: the generation finished


@dataclass(frozen=True)
class Park:
    request_id: str


@dataclass(frozen=True)
class Unpark:
    request_id: str


@dataclass(frozen=True)
class Restored:
    """A row parked in the store, read back (plan) or not (error)."""

    request_id: str
    plan: ResumePlan | None
    error: str = ""


@dataclass(frozen=True)
class Stop:
    pass


Command = Submit | Cancel | Park | Unpark | Restored | Stop
