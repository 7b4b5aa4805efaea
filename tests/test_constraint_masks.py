"""The batch masks of structured output (engine_service/sampling/masks.py) in-process: rows
that join a running batch at different steps are masked together with the batch after their
first step, keep their constraints, and give the tokens of their solo runs, in either order
of a step's host work; the ordering follows the device's wait; the bitmask
leaves unconstrained rows' logits bit for bit and forbids a padded vocabulary's columns."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from engine_service.loop.limits import Limits
from engine_service.loop.scheduler import Scheduler
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.constraint import Constraint, ConstraintKind
from engine_service.protocol.events import Finished
from engine_service.protocol.requests import GenerationRequest, stop_token_ids
from engine_service.protocol.sampling_options import SamplingOptions
from engine_service.sampling.constraints import ConstrainedRow, apply_bitmask
from engine_service.sampling.masks import StepOrder
from tests.generation_rows import Collector

DATE = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"
POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99},
        "y": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["x", "y"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    Constraint(ConstraintKind.REGEX, DATE),
    Constraint(ConstraintKind.CHOICE, choices=("north", "south", "east", "west")),
    Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(POINT)),
    None,
    Constraint(ConstraintKind.REGEX, "[a-z]{3,40}"),
    None,
]


@pytest.fixture(scope="module")
def tiny(engine_data_dir: Path) -> LoadedModel:
    return load_model("", engine_data_dir)


def _request(loaded: LoadedModel, i: int, constraint: Constraint | None) -> GenerationRequest:
    options = SamplingOptions(ignore_eos=True, temperature=1.0, seed=i, constraint=constraint)
    return GenerationRequest(
        request_id=f"r{i}",
        prompt=[40 + i, 41 + i, 42 + i, 43],
        max_tokens=48,
        sampling=options,
        namespace="default",
        stop_ids=stop_token_ids(options, loaded.eos_token_ids),
        layout=list(loaded.layout),
    )


def _run(
    loaded: LoadedModel, indices: list[int], staggered: bool, order: StepOrder | None = None
) -> dict[int, Collector]:
    """Each request's events; staggered: each joins after the one before it made a token, so
    new rows keep arriving in a running batch."""
    scheduler = Scheduler(loaded, Limits(max_running=8, max_queued=8))
    if order is not None:
        scheduler._masks.order = order
    scheduler.start()
    sinks = {}
    try:
        for i in indices:
            sinks[i] = Collector()
            scheduler.submit(_request(loaded, i, CONSTRAINTS[i]), sinks[i])
            while staggered and not sinks[i].tokens and not sinks[i].done.is_set():
                sinks[i].done.wait(0.001)
        for sink in sinks.values():
            sink.wait()
        if staggered:
            assert scheduler._masks.batch_steps > 10  # the batch, not the rows, masked
    finally:
        scheduler.shutdown()
    return sinks


@pytest.mark.parametrize("read_first", [True, False], ids=["read-first", "queued-first"])
def test_rows_joining_a_running_batch_are_masked_with_it_and_equal_their_solo_runs(
    tiny: LoadedModel, read_first: bool
) -> None:
    # Either order of a step's host work (StepOrder): fed tokens read before the forward
    # pass is queued, masks made beside it; or the forward queued first, masks after.
    order = StepOrder(wait_threshold_s=math.inf if read_first else -1.0, retry_after=10**9)
    batched = _run(tiny, list(range(len(CONSTRAINTS))), staggered=True, order=order)
    if read_first:
        assert order.read_first_steps > 10 and order.queued_first_steps == 0
    else:
        assert order.queued_first_steps > 10 and order.read_first_steps == 4
    for i, sink in batched.items():
        text = tiny.tokenizer.decode(sink.tokens[:-1] if CONSTRAINTS[i] else sink.tokens)
        finished = sink.wait()
        if CONSTRAINTS[i] is None:
            assert finished.reason == "length" and len(sink.tokens) == 48
        else:
            assert finished.reason == "stop" and not finished.constraint_incomplete, text
        if i == 0:
            assert re.fullmatch(DATE, text), text
        elif i == 1:
            assert text in ("north", "south", "east", "west"), text
        elif i == 2:
            jsonschema.validate(json.loads(text), POINT)
        elif i == 4:
            assert re.fullmatch("[a-z]{3,40}", text), text
        solo = _run(tiny, [i], staggered=False)[i]
        assert sink.tokens == solo.tokens, i


def test_a_row_cut_by_max_tokens_under_batch_masks_says_so(tiny: LoadedModel) -> None:
    scheduler = Scheduler(tiny, Limits(max_running=4, max_queued=4))
    scheduler.start()
    try:
        long = Constraint(ConstraintKind.REGEX, "[a-z]{400}")
        sinks = [Collector(), Collector()]
        for i, sink in enumerate(sinks):
            scheduler.submit(_request(tiny, 10 + i, long if i == 0 else None), sink)
        finished = [s.wait() for s in sinks]
    finally:
        scheduler.shutdown()
    assert finished[0].reason == "length" and finished[0].constraint_incomplete
    assert re.fullmatch("[a-z]+", tiny.tokenizer.decode(sinks[0].tokens))
    assert finished[1].reason == "length" and not finished[1].constraint_incomplete
    assert all(isinstance(s.events[-1], Finished) for s in sinks)


def test_the_bitmask_forbids_only_masked_rows_tokens_and_padded_columns() -> None:
    logits = mx.random.normal((3, 1, 70))  # a vocabulary of 64 padded to 70 columns
    bitmask = np.full((3, 2), -1, dtype=np.int32)
    bitmask[0] = [0b1011, 0]  # row 0 allows tokens 0, 1 and 3
    bitmask[2] = [0, -(1 << 31)]  # row 2 allows token 63 alone (the top bit)
    masked = np.array([True, False, True])
    out = np.array(apply_bitmask(logits, bitmask, masked))
    base = np.array(logits)
    assert np.array_equal(out[1], base[1])  # an unconstrained row: untouched, padding too
    assert np.flatnonzero(np.isfinite(out[0, 0])).tolist() == [0, 1, 3]
    assert np.flatnonzero(np.isfinite(out[2, 0])).tolist() == [63]
    assert np.array_equal(out[0, 0, [0, 1, 3]], base[0, 0, [0, 1, 3]])


def test_a_processor_left_in_mlx_lms_rows_still_masks_every_step(tiny: LoadedModel) -> None:
    """The per-row path (used where BatchMasks cannot take a row over) consumes each fed
    token itself."""
    from engine_service.sampling.constraints import Grammars

    grammars = Grammars.for_model(tiny)
    row: ConstrainedRow = grammars.row(Constraint(ConstraintKind.REGEX, "[0-9][a-z]"), [])
    logits = mx.zeros((1, tiny.vocab_size))

    def allowed(out: mx.array) -> list[str]:
        return [tiny.tokenizer.decode([int(t)]) for t in np.flatnonzero(np.isfinite(out[0]))]

    first = allowed(row(mx.array([7]), logits))
    assert "7" in first and all(re.fullmatch("[0-9][a-z]?", text) for text in first), first
    seven = next(t for t in range(tiny.vocab_size) if tiny.tokenizer.decode([t]) == "7")
    second = allowed(row(mx.array([7, seven]), logits))
    assert "q" in second and all(re.fullmatch("[a-z]", text) for text in second), second
    q = next(t for t in range(tiny.vocab_size) if tiny.tokenizer.decode([t]) == "q")
    assert row.consumed == 1 and row.complete([seven, q]) and not row.complete([seven])


def test_the_step_order_queues_first_while_reads_wait_and_tries_again_later() -> None:
    order = StepOrder(wait_threshold_s=0.001, retry_after=3)
    for _ in range(6):
        order.waited(0.0001)  # the device keeps up: masks beside the host's graph building
    assert order.read_first
    for _ in range(4):
        order.waited(0.010)  # the device is behind: the read would idle it
    assert not order.read_first
    for _ in range(3):
        order.queued_first()
    assert order.read_first and order.queued_first_steps == 3
