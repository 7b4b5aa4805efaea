"""Rows of a real Scheduler over the embedded model, for in-process tests: a request's event
sink, waiting on observable state, kept (resumable) generations and what their resumes must
continue exactly."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step

from engine_service.checkpoints.generations import GenerationCheckpoints
from engine_service.checkpoints.manager import CheckpointManager
from engine_service.core.planner import Planner
from engine_service.core.plans import ResumePlan
from engine_service.kv.batch_cache import BatchQuantizedKVCache
from engine_service.loop.limits import Limits
from engine_service.loop.scheduler import Scheduler
from engine_service.model.loaded import LoadedModel
from engine_service.protocol.events import Event, Finished, Started, Token
from engine_service.protocol.kv_codec import PLAIN_KV, KVCodec
from engine_service.protocol.requests import (
    EXACT_RECORD,
    DraftSupport,
    GenerationRequest,
    RecordFormat,
    stop_token_ids,
)
from engine_service.protocol.sampling_options import SamplingOptions


class Collector:
    """A request's sink: events arrive on the MLX thread, tests wait for Finished."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, events: list[Event]) -> None:
        self.events.extend(events)
        if any(isinstance(e, Finished) for e in events):
            self.done.set()

    def wait(self, timeout: float = 60.0) -> Finished:
        assert self.done.wait(timeout), "no Finished event"
        finished = [e for e in self.events if isinstance(e, Finished)]
        assert len(finished) == 1 and self.events[-1] is finished[0]
        return finished[0]

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, Token)]

    @property
    def started(self) -> Started:
        return next(e for e in self.events if isinstance(e, Started))


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Polls an observable condition until it holds; fails naming it after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:g} s"
        time.sleep(0.01)


def request_for(
    loaded: LoadedModel,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    kv: KVCodec = PLAIN_KV,
    **sampling: object,
) -> GenerationRequest:
    options = SamplingOptions(ignore_eos=True, **sampling)  # type: ignore[arg-type]
    return GenerationRequest(
        request_id=rid,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=options,
        namespace="default",
        stop_ids=stop_token_ids(options, loaded.eos_token_ids),
        kv=kv,
        layout=list(loaded.layout),
    )


def submit_all(
    scheduler: Scheduler, loaded: LoadedModel, tag: str, prompts: list[list[int]], n: int
) -> list[Collector]:
    """Each prompt submitted as request f"{tag}-{i}" of n tokens, plain KV; their sinks."""
    sinks = [Collector() for _ in prompts]
    for i, (prompt, sink) in enumerate(zip(prompts, sinks, strict=True)):
        scheduler.submit(request_for(loaded, f"{tag}-{i}", prompt, n, KVCodec()), sink)
    return sinks


def ended_as(expected: list[list[int]], sinks: list[Collector], timeout: float) -> None:
    """Every stream ended by its length with exactly its reference's tokens."""
    for want, sink in zip(expected, sinks, strict=True):
        end = sink.wait(timeout)
        assert end.reason == "length", end.error
        assert sink.tokens == want


def greedy(loaded: LoadedModel, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's solo greedy tokens: the reference. Take it while no Scheduler's MLX thread runs
    rows (before start, while idle, after shutdown): the engine evaluates MLX on one thread,
    and a reference evaluated beside its steps came out wrong in CI (a token 3.3 logits from
    the top one, at the 91st of 104)."""
    return [int(t) for t, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=n)]


def kept_generation(
    tiny: LoadedModel,
    checkpoints: CheckpointManager,
    prompt: Sequence[int] = (7, 8, 9, 10),
    tokens: int = 60,
    rid: str = "kept",
    all_sent: bool = True,
    planned: bool = True,
    record: RecordFormat = EXACT_RECORD,
    emitted: list[int] | None = None,
) -> tuple[GenerationRequest, bytes]:
    """A checkpointed generation of `tokens`-odd tokens whose client went away: a client that
    goes away keeps its checkpoint (finished ones are deleted). Its request and generation
    key. Planned as the engine's core plans it (a stored prefix of its prompt restored).
    all_sent: every record it queued reached the store (else only the flush's end).
    planned: False to prefill its whole prompt whatever is stored. record: how its prompt's
    prefix record is kept (and which records it restores). emitted: extended with the tokens
    the row sent."""
    scheduler = Scheduler(tiny, Limits(max_running=2), checkpoints=checkpoints)
    scheduler.start()
    request = request_for(tiny, rid, list(prompt), 4000)
    request.checkpoint_interval = 8
    request.prefix_record = record
    sink = Collector()
    planner = Planner(checkpoints, DraftSupport())
    plan = planner.plan(request) if planned and planner.needed(request) else None
    scheduler.submit(request, sink, plan)
    wait_for(lambda: len(sink.tokens) >= tokens, f"{tokens} tokens of the kept row")
    scheduler.cancel(rid, keep_checkpoint=True)
    sink.wait()
    scheduler.shutdown()
    if emitted is not None:
        emitted.extend(sink.tokens)
    flushed = checkpoints.flush()
    assert flushed.durable or (not all_sent and flushed.missing == 0)
    gens = checkpoints.generations
    return request, gens.key("default", request.prompt, request.sampling, rid, request.layout)


def continues_exactly(
    tiny: LoadedModel, gens: GenerationCheckpoints, plan: ResumePlan, prompt: list[int]
) -> None:
    """The restored caches continue exactly as the uninterrupted generation did."""
    caches = gens.loads.materialize(plan)
    assert caches[0].offset == len(prompt) + len(plan.generated)
    # Joined with a batch step of room: a lone resumed row joins its batch without a copy.
    assert caches[0].keys.shape[2] == caches[0].offset + BatchQuantizedKVCache.step
    full = greedy(tiny, prompt, len(plan.replay) + 1)
    assert plan.replay == full[:-1]
    logits = tiny.model(mx.array([[plan.pending]]), cache=caches)
    assert mx.argmax(logits[0, -1]).item() == full[-1]
