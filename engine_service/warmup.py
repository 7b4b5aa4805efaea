"""Running the engine's batch shapes once before it serves.

MLX-CUDA compiles a kernel the first time a shape and dtype need it (seconds on a cold
start), and the first request would wait for that. The warm-up goes through the same path
as a request (NewRows: the batch's cache rows, samplers, stop sequences) into the loop's own
BatchGenerator, on the MLX thread, without touching stats, caches or the store.
"""

from __future__ import annotations

import logging
import time

from mlx_lm.generate import BatchGenerator

from engine_service.jobs import Job, StartingPoint
from engine_service.kv_codec import PLAIN_KV, KVCodec
from engine_service.model import LoadedModel
from engine_service.new_rows import NewRows
from engine_service.requests import GenerationRequest
from engine_service.sampling import SamplingOptions

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
    A failure is logged: serving still works, only the first requests wait."""
    try:
        _run(bg, loaded, batch_sizes, long, kv)
    except Exception:  # noqa: BLE001 - see above
        log.exception("warm-up failed; the first requests compile their shapes")


def _run(
    bg: BatchGenerator, loaded: LoadedModel, batch_sizes: list[int], long: int, kv: KVCodec
) -> None:
    started = time.monotonic()
    rounds = [(1, max(SHORT_PROMPT, min(long, LONG_PROMPT)))]
    rounds += [(n, SHORT_PROMPT) for n in sorted(set(batch_sizes)) if n > 0]
    for n, length in rounds:
        rows = NewRows(loaded.model)
        for i in range(n):
            prompt = _prompt(length, i, loaded.vocab_size)
            request = GenerationRequest(f"warmup-{i}", prompt, TOKENS, SamplingOptions(), "", kv=kv)
            rows.add(Job(request, _discard), StartingPoint(prompt, [], None, 0))
        rows.insert(bg)
        left = {job.uid for job in rows.jobs}
        while left:
            _, responses = bg.next()
            left -= {r.uid for r in responses if r.finish_reason is not None}
    log.info("warmed up %s in %.2f s", [n for n, _ in rounds], time.monotonic() - started)
