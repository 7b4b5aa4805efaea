"""Constraint compiling never on the batch loop and never past its budget (issue 32): the
front's compiles run on a pool of their own and wait at most --constraint-compile-timeout (an
overrun is refused as too complex and remembered, a wait behind others' compiles is
RESOURCE_EXHAUSTED); the core prepares each constraint's matcher on its planning pool, and a
row on the loop only copies it (engine_service/sampling/constraint_compiler.py,
sampling/constraints.py).

The compiles here are stand-ins held on events, so what is refused does not depend on how
fast this machine compiles; the matchers are llguidance's own on the tiny model."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import numpy as np
import pytest

from engine_service.errors import InvalidRequest, Overloaded
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.constraint import Constraint, ConstraintKind
from engine_service.sampling.constraint_compiler import CompileBudget
from engine_service.sampling.constraints import Grammars, mask_words


def test_a_compile_past_its_budget_is_refused_and_remembered() -> None:
    # 1 s: a thread that waited past half of it for the CPU would count as "busy" instead.
    budget = CompileBudget(timeout_s=1.0, workers=1)
    release = threading.Event()
    ran: list[str] = []

    def slow() -> str:
        ran.append("slow")
        release.wait(30)
        return "grammar"

    try:
        with pytest.raises(InvalidRequest, match="did not compile within 1 s"):
            budget.run("digest-a", "constraint (lark)", slow)
        release.set()
        # The same constraint again: refused at once, without taking a compile thread.
        with pytest.raises(InvalidRequest, match="too complex"):
            budget.run("digest-a", "constraint (lark)", slow)
        assert ran == ["slow"] and budget.refused_too_complex == 2
        # Another constraint compiles as usual.
        assert budget.run("digest-b", "constraint (regex)", lambda: "ok") == "ok"
    finally:
        release.set()
        budget.close()


def test_a_compile_waiting_behind_others_is_overloaded_not_blamed() -> None:
    budget = CompileBudget(timeout_s=0.2, workers=1)
    busy, release = threading.Event(), threading.Event()

    def hog() -> None:
        busy.set()
        release.wait(30)

    try:
        hogging = threading.Thread(target=lambda: _holds_the_pool(budget, "hog", hog))
        hogging.start()
        assert busy.wait(30)
        with pytest.raises(Overloaded, match="busy compiling other constraints"):
            budget.run("digest-c", "constraint (regex)", lambda: "never ran")
        release.set()
        hogging.join(30)
        # Not remembered: once the pool is free it compiles.
        assert budget.run("digest-c", "constraint (regex)", lambda: "ok") == "ok"
        assert budget.refused_busy >= 1  # the hog's own verdict may be "busy" too (below)
    finally:
        release.set()
        budget.close()


def _holds_the_pool(budget: CompileBudget, digest: str, compile_it: object) -> None:
    """Runs compile_it through the budget, holding the pool's one worker until it returns.
    Its own verdict is not what the test is about, and depends on when this thread gets the
    CPU: too complex if it started at once, busy if it started late, or the result itself if
    the thread woke only after the release (a loaded machine: seen under three workers)."""
    with contextlib.suppress(InvalidRequest, Overloaded):
        budget.run(digest, "constraint (lark)", compile_it)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny(engine_data_dir: Path) -> LoadedModel:
    return load_model("", engine_data_dir)


def _mask(row_matcher: object, vocab_size: int) -> list[int]:
    bits = np.zeros(mask_words(vocab_size), dtype=np.int32)
    row_matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)  # type: ignore[attr-defined]
    return [int(b) for b in bits]


def test_rows_copy_the_prepared_matcher_and_mask_as_a_fresh_one(tiny: LoadedModel) -> None:
    grammars = Grammars.for_model(tiny)
    constraint = Constraint(ConstraintKind.CHOICE, choices=("alpha", "beta", "gamma"))
    grammars.prepare(constraint)  # what the core does on its planning pool
    generated = [int(t) for t in tiny.tokenizer.encode("al", add_special_tokens=False)]
    prepared = grammars.row(constraint, generated)
    again = grammars.row(constraint, [])
    assert grammars.built_on_loop == 0
    # A copy is independent of the template and of other rows.
    other = Grammars.for_model(tiny)
    fresh = other.row(constraint, generated)
    assert other.built_on_loop == 1  # not prepared: built where it was asked for
    assert _mask(prepared.matcher, tiny.vocab_size) == _mask(fresh.matcher, tiny.vocab_size)
    assert _mask(again.matcher, tiny.vocab_size) != _mask(prepared.matcher, tiny.vocab_size)
    # A constraint the core cannot prepare is refused there, before any row.
    with pytest.raises(InvalidRequest, match="constraint"):
        grammars.prepare(Constraint(ConstraintKind.LARK, "start: (((("))
