"""A row whose first token ends it (a 1-token request, or a stop token first) ends its stream
with that token: the Finished leaves in the same delivery as the token, not a decode step
later (loop/first_tokens.py `_send_first_tokens`, `Job.ending_at`). The row itself leaves the
batch when the next step reports it, so the rows beside it go on exactly. And a client gone
at its first token (sent ahead of that step) leaves a generation that resumes.

In-process, on the tiny model: each request's sink records its deliveries as they came.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from engine_service.checkpoints.manager import CheckpointManager, CheckpointSettings
from engine_service.loop.limits import Limits
from engine_service.loop.scheduler import Scheduler
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.events import Event, Finished, Token
from engine_service.protocol.requests import GenerationRequest
from store_service.config import StoreConfig
from store_service.server import create_server
from store_service.store import CheckpointStore
from tests.generation_rows import greedy
from tests.zoo_checks import request


class Deliveries:
    """A request's sink: each delivery's events, in order, and the engine's step count (steps
    that reported tokens) when each came."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.deliveries: list[list[Event]] = []
        self.steps: list[int] = []
        self.done = threading.Event()

    def __call__(self, events: list[Event]) -> None:  # on the loop thread, as it delivers
        self.steps.append(self.scheduler.stats().steps_total)
        self.deliveries.append(list(events))
        if any(isinstance(e, Finished) for e in events):
            self.done.set()

    def finished(self) -> Finished:
        assert self.done.wait(120), "no Finished event in 120 s"
        last = self.deliveries[-1][-1]
        assert isinstance(last, Finished)
        return last

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for d in self.deliveries for e in d if isinstance(e, Token)]


@pytest.fixture(scope="module")
def tiny(engine_data_dir: Path) -> LoadedModel:
    return load_model("", engine_data_dir)


def _request(
    loaded: LoadedModel, rid: str, prompt: list[int], n: int, stops: frozenset[int] = frozenset()
) -> GenerationRequest:
    plain = request(loaded, rid, prompt, max_tokens=n, namespace="default")
    return dataclasses.replace(plain, stop_ids=plain.stop_ids | stops)


def test_a_one_token_request_ends_with_its_token_and_its_neighbour_goes_on(
    tiny: LoadedModel,
) -> None:
    short, long = list(range(30, 70)), list(range(100, 160))
    want_short, want_long = greedy(tiny, short, 6), greedy(tiny, long, 24)
    scheduler = Scheduler(tiny, Limits(max_running=4, max_queued=4))
    scheduler.start()
    try:
        one, many = Deliveries(scheduler), Deliveries(scheduler)
        scheduler.submit(_request(tiny, "many", long, 24), many)
        scheduler.submit(_request(tiny, "one", short, 1), one)
        end = one.finished()
        assert end.reason == "length"
        # Token and Finished in one delivery, before any step reported its token (the
        # step count is that of its first delivery, Started): it ended with its token.
        assert len(one.deliveries[-1]) == 2 and isinstance(one.deliveries[-1][0], Token)
        assert one.steps[-1] == one.steps[0]
        assert one.tokens == want_short[:1]
        # Its id is free with its Finished, though its row may still be in the batch: a new
        # request of the same id is taken at once and runs as alone.
        again = Deliveries(scheduler)
        scheduler.submit(_request(tiny, "one", short, 6), again)
        assert many.finished().reason == "length"
        assert many.tokens == want_long
        again.finished()
        assert again.tokens == want_short
        # Nothing came to the first after its Finished (its row's report a step later).
        assert sum(isinstance(e, Finished) for d in one.deliveries for e in d) == 1
    finally:
        scheduler.shutdown()


def test_a_stop_token_first_ends_the_stream_with_it(tiny: LoadedModel) -> None:
    prompt = list(range(40, 90))
    first = greedy(tiny, prompt, 1)[0]
    scheduler = Scheduler(tiny, Limits(max_running=4, max_queued=4))
    scheduler.start()
    try:
        sink = Deliveries(scheduler)
        scheduler.submit(_request(tiny, "stops", prompt, 16, frozenset({first})), sink)
        end = sink.finished()
        assert (end.reason, end.stop_token) == ("stop", first)
        assert sink.tokens == [first]
        assert isinstance(sink.deliveries[-1][0], Token) and len(sink.deliveries[-1]) == 2
        assert sink.steps[-1] == sink.steps[0]
    finally:
        scheduler.shutdown()


def test_a_client_gone_at_its_first_token_leaves_a_generation_that_resumes(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """The core's Cancel for a client gone (its checkpoint kept) arrives right after the first
    token went ahead, before the step that reports it, whose end takes the first snapshot:
    the row ends only after that, so the store holds a generation that resumes (it was
    removed first and left none: tests/test_engine_zoo_processes.py raced so under load)."""
    store = CheckpointStore(StoreConfig(data_dir=tmp_path / "store"))
    server, port, _ = create_server(store, "127.0.0.1:0")
    server.start()
    settings = CheckpointSettings(store=f"127.0.0.1:{port}", store_region_bytes=0)
    checkpoints = CheckpointManager(tiny, settings)
    scheduler = Scheduler(tiny, Limits(max_running=2), checkpoints=checkpoints)
    scheduler.start()
    prompt = list(range(40, 90))
    request = _request(tiny, "gone", prompt, 48)
    request.checkpoint_interval = 1000  # none comes due: only the first snapshot

    class GoneAtFirstToken(Deliveries):
        def __call__(self, events: list[Event]) -> None:
            super().__call__(events)
            if len(self.tokens) == 1 and any(isinstance(e, Token) for e in events):
                # On the loop thread, as it delivers: drained before the next step.
                scheduler.cancel("gone", keep_checkpoint=True)

    try:
        sink = GoneAtFirstToken(scheduler)
        scheduler.submit(request, sink)
        assert sink.finished().reason == "cancelled"
        scheduler.shutdown()
        assert checkpoints.flush().durable
        gens = checkpoints.generations
        key = gens.key("default", prompt, request.sampling, "gone", request.layout)
        plan = gens.loads.load(key, "default", prompt, request.layout)
        assert plan.replay[0] == sink.tokens[0]
        assert plan.replay == greedy(tiny, prompt, len(plan.replay))  # its MLX thread stopped
        plan.release()
    finally:
        scheduler.shutdown()
        checkpoints.close()
        server.stop(None).wait()
        store.close()
