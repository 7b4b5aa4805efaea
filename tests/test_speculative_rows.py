"""Speculative rows batched in a running engine: eight concurrent requests, some speculative
(different draft lengths), some not, each equal to its non-speculative run on the plain,
sliding-window and hybrid tiny models, rollbacks counted by Stats; and a batched speculative
row SIGKILLed mid-stream resumed equal to the uninterrupted run."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem_client import EngineClient, StoreClient
from tandem_client.errors import TandemError
from tests.servers import kill_after_checkpoint, start_engine

# Draft lengths of the eight requests; 0: not speculative (the engine's main batch).
DRAFTS = [3, 0, 1, 5, 0, 2, 6, 0]
TOKENS = 36


def _prompt(j: int) -> list[int]:
    return [(i * 613 + j * 101) % 2000 + 3 for i in range(20 + 11 * j)]


def _options(j: int) -> dict[str, Any]:
    sampled = dict(temperature=0.7, seed=11 + j) if j % 3 == 1 else {}
    return dict(max_tokens=TOKENS, ignore_eos=True, **sampled)


def _concurrently(address: str, requests: list[dict[str, Any]]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in requests]
    errors: list[BaseException] = []

    def run(j: int) -> None:
        try:
            with EngineClient(address) as engine:
                out[j] = engine.generate(_prompt(j), **requests[j]).token_ids
        except BaseException as exc:  # surfaced below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(j,)) for j in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


@pytest.mark.parametrize("model", ["tandem-tiny", "tandem-tiny-swa", "tandem-tiny-hybrid"])
def test_mixed_speculative_batch_equals_plain_runs(
    model: str, engine_data_dir: Path, tmp_path: Path
) -> None:
    proc = start_engine(
        engine_data_dir,
        "--model",
        model,
        "--draft-model",
        "tandem-tiny-draft",
        log_dir=tmp_path,
    )
    try:
        speculative = [{**_options(j), "num_draft_tokens": d} for j, d in enumerate(DRAFTS)]
        mixed = _concurrently(proc.address, speculative)
        plain = _concurrently(proc.address, [_options(j) for j in range(len(DRAFTS))])
        with EngineClient(proc.address) as engine:
            spec = engine.stats()
        for j, (got, want) in enumerate(zip(mixed, plain, strict=True)):
            assert len(want) == TOKENS
            assert got == want, (model, j, DRAFTS[j])
        assert spec.draft_tokens_total > spec.accepted_draft_tokens_total > 0
        assert spec.speculative_rollbacks_total >= 10  # rejected proposals rolled back
        assert spec.speculative_rounds_total < sum(TOKENS for d in DRAFTS if d)
    finally:
        proc.stop()


def test_a_stop_token_inside_a_round_ends_its_row_there(
    engine_data_dir: Path, tmp_path: Path
) -> None:
    """Each of four seeded speculative rows stops at a token its plain run makes midway: the row
    ends there (nothing of its round past the stop is sent), as plain decoding ends it, while
    the others go on."""
    proc = start_engine(engine_data_dir, "--draft-model", "tandem-tiny-draft", log_dir=tmp_path)
    try:
        rows = range(4)
        sampled = [dict(max_tokens=TOKENS, ignore_eos=True, temperature=0.7, seed=j) for j in rows]
        free = _concurrently(proc.address, sampled)
        # A token each row first makes midway (or its last token, for a row that repeats one).
        stops = [
            next((t for i, t in enumerate(free[j]) if i >= 6 and t not in free[j][:i]), free[j][0])
            for j in rows
        ]
        plain = [{**sampled[j], "stop_token_ids": [stops[j]]} for j in rows]
        speculative = [{**plain[j], "num_draft_tokens": 4} for j in rows]
        with EngineClient(proc.address) as engine:
            want = [engine.generate(_prompt(j), **plain[j]) for j in rows]
        got = _concurrently(proc.address, speculative)
        assert sum(len(w.token_ids) > 6 for w in want) >= 2  # rows stopped midway
        for j in rows:
            assert want[j].finish_reason == "stop"
            assert got[j] == want[j].token_ids, j
            assert got[j][-1] == stops[j] and stops[j] not in got[j][:-1]
    finally:
        proc.stop()


def test_batched_speculative_row_resumes_after_sigkill(draft_stack: dict[str, Any]) -> None:
    """A checkpointed speculative row streams beside two other speculative rows; the engine
    is SIGKILLed; on a fresh engine the resume (draft cache from its attachment) continues
    it: received + resumed == the uninterrupted plain run."""
    proc, port = draft_stack["engine"], draft_stack["port"]
    prompt = _prompt(5)
    request = dict(
        max_tokens=72,
        ignore_eos=True,
        checkpoint_interval=8,
        request_id="spec-batched",
        num_draft_tokens=4,
    )
    ends: list[tuple[int, Any]] = []
    companions = [
        threading.Thread(target=_companion, args=(proc.address, j, ends), daemon=True)
        for j in (1, 2)
    ]
    for thread in companions:
        thread.start()
    with StoreClient(f"127.0.0.1:{port}") as store:
        received, checkpoint = kill_after_checkpoint(proc, store, prompt, request, 30, 20)
    for thread in companions:
        thread.join(30)
    # Both companions were decoding beside it when the engine died.
    assert [code for _, code in ends] == [grpc.StatusCode.UNAVAILABLE] * 2
    assert all(tokens > 0 for tokens, _ in ends)
    (attachment,) = checkpoint.attachments
    assert attachment.metadata["boundary"] == str(len(checkpoint.token_ids))
    draft_stack["engine"] = proc = draft_stack["start_engine"]()
    with EngineClient(proc.address) as client:
        resumed = client.generate(prompt, resume=True, tokens_held=len(received), **request)
        assert resumed.usage is not None
        assert resumed.usage.cached_prompt_tokens == len(prompt)
        assert resumed.usage.draft_tokens > 0
        plain = {**request, "num_draft_tokens": 0, "request_id": "plain"}
        full = client.generate(prompt, **plain).token_ids
    assert len(full) == 72
    assert received + resumed.token_ids == full


def _companion(address: str, j: int, ends: list[tuple[int, Any]]) -> None:
    """A speculative row sharing the batch until the engine dies: (tokens read, status)."""
    tokens = 0
    try:
        with EngineClient(address) as engine:
            for chunk in engine.stream(
                _prompt(j), max_tokens=400, ignore_eos=True, num_draft_tokens=j
            ):
                tokens += len(chunk.token_ids)
    except TandemError as exc:  # the engine is killed under it
        ends.append((tokens, exc.code))
        return
    ends.append((tokens, grpc.StatusCode.OK))


def test_a_row_leaving_the_speculative_batch_leaves_the_others_exact(
    engine_data_dir: Path, tmp_path: Path
) -> None:
    """Four speculative rows decode together; while two of them are midway, one client goes
    away and one request is cancelled by id: their rows leave the batch (its caches filtered
    around the others), and the two that stay equal their non-speculative runs."""
    proc = start_engine(engine_data_dir, "--draft-model", "tandem-tiny-draft", log_dir=tmp_path)
    try:
        long = dict(max_tokens=400, ignore_eos=True, num_draft_tokens=3)
        staying = {j: {**_options(j), "max_tokens": 120, "num_draft_tokens": 2 + j} for j in (0, 3)}
        got: dict[int, list[int]] = {j: [] for j in staying}
        midway = threading.Barrier(len(staying) + 1)

        def stay(j: int) -> None:
            passed = False
            with EngineClient(proc.address) as engine:
                for chunk in engine.stream(_prompt(j), **staying[j]):
                    got[j] += chunk.token_ids
                    if not passed and len(got[j]) >= 10:
                        passed = True
                        midway.wait(30)

        with EngineClient(proc.address) as engine:
            cancelled = engine.stream(_prompt(2), request_id="to-cancel", **long)
            leaving = engine.stream(_prompt(1), **long)
            next(cancelled), next(leaving)
            threads = [threading.Thread(target=stay, args=(j,)) for j in staying]
            for t in threads:
                t.start()
            midway.wait(30)  # both staying rows are decoding beside the two
            leaving.close()  # the client goes away
            engine.cancel("to-cancel")
            ends = [chunk.finish_reason for chunk in cancelled if chunk.finish_reason]
            for t in threads:
                t.join(120)
            plain = {
                j: engine.generate(_prompt(j), **{**staying[j], "num_draft_tokens": 0})
                for j in staying
            }
            stats = engine.stats()
        assert ends == ["cancelled"]
        assert got == {j: g.token_ids for j, g in plain.items()}
        assert stats.running == 0
    finally:
        proc.stop()
