"""Running the engine's batch shapes once before it serves.

A warm-up that fails stops start-up (WarmUpFailed): an engine that cannot run its own
shapes would otherwise say SERVING and fail every request. MLX-CUDA compiles a kernel the
first time a shape and dtype need it (seconds on a cold start), and the first request would
wait for that. The warm-up goes through the same path as a request (NewRows: the batch's
cache rows, samplers, stop sequences) into the loop's own BatchGenerator, on the MLX thread,
without touching stats, caches or the store.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from mlx_lm.generate import BatchGenerator

from engine_service.loop.jobs import Job, StartingPoint
from engine_service.loop.new_rows import NewRows
from engine_service.model.loaded import LoadedModel
from engine_service.protocol.kv_codec import PLAIN_KV, KVCodec
from engine_service.protocol.requests import GenerationRequest
from engine_service.protocol.sampling_options import SamplingOptions

log = logging.getLogger(__name__)

SHORT_PROMPT = 32
LONG_PROMPT = 1024  # at most; a long prefill uses other attention kernels
TOKENS = 4


def _discard(events: object) -> None:
    pass


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % vocab for i in range(length)]


def warm_up(
    bg: BatchGenerator,
    loaded: LoadedModel,
    batch_sizes: list[int],
    long: int,
    kv: KVCodec = PLAIN_KV,
) -> None:
    """One long prefill, then a few tokens at each decode batch size the engine will run, with
    the engine's default KV codec (a TurboQuant default builds and checks its kernels here).
    Raises WarmUpFailed."""
    started = time.monotonic()
    rounds = [(1, max(SHORT_PROMPT, min(long, LONG_PROMPT)))]
    rounds += [(n, SHORT_PROMPT) for n in sorted(set(batch_sizes)) if n > 0]
    try:
        for n, length in rounds:
            generate_rows(bg, loaded, [ProbeRow(length, kv)] * n, TOKENS)
    except Exception as exc:
        raise WarmUpFailed(f"the warm-up failed ({n} rows of {length} tokens): {exc}") from exc
    log.info("warmed up %s in %.2f s", [n for n, _ in rounds], time.monotonic() - started)


class WarmUpFailed(RuntimeError):
    """The model could not run the engine's own batch shapes: the engine does not serve."""


@dataclass(frozen=True)
class ProbeRow:
    """A row the engine runs for itself: a made-up prompt's length and its KV codec."""

    prompt_tokens: int
    kv: KVCodec = PLAIN_KV


def generate_rows(
    bg: BatchGenerator, loaded: LoadedModel, rows: list[ProbeRow], tokens: int
) -> None:
    """Runs made-up rows through the request path (NewRows, the batch) until each has
    `tokens` tokens; whatever the model raises goes to the caller."""
    new = NewRows(loaded.model)
    for i, row in enumerate(rows):
        prompt = _prompt(row.prompt_tokens, i, loaded.vocab_size)
        request = GenerationRequest(f"warmup-{i}", prompt, tokens, SamplingOptions(), "", kv=row.kv)
        new.add(Job(request, _discard), StartingPoint(prompt, [], None, 0))
    new.insert(bg)
    left = {job.uid for job in new.jobs}
    while left:
        _, responses = bg.next()
        left -= {r.uid for r in responses if r.finish_reason is not None}
