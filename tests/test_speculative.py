"""Speculative decoding with a draft model, and its checkpoints carrying the draft's cache as
an attachment: same tokens as plain decoding, exact resume after SIGKILL, and refusals."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step

from engine_service.checkpoints.attachments import DRAFT_SCHEMA
from engine_service.model.loading import load_model
from engine_service.protocol.sampling_options import SamplingOptions
from engine_service.sampling.samplers import SeededSampler
from engine_service.speculative.batch import SpecRow, SpeculativeBatch, prefilled
from tandem_client import EngineClient, StoreClient
from tandem_client.errors import TandemError

TEXT = "The quick brown fox jumps over the lazy dog. "
PROMPT = [(i * 977) % 2000 + 3 for i in range(300)]


def _solo(
    target: Any, draft: Any, prompt: list[int], options: SamplingOptions, k: int
) -> SpeculativeBatch:
    """A speculative batch of one row."""
    batch = SpeculativeBatch(target, draft)
    row = SpecRow("solo", list(prompt), 0, k, options)
    batch.add(row, prefilled(target, prompt[:-1]), prefilled(draft, prompt[:-2]))
    return batch


def _run(batch: SpeculativeBatch, n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        (result,) = batch.round([n - len(out)])
        out += result.tokens
    return out


def test_decoder_matches_mlx_lm_speculative_and_plain_decoding(
    reference: Any, engine_data_dir: Path
) -> None:
    target = reference.model
    draft = load_model("tandem-tiny-draft", engine_data_dir).model
    prompt = reference.tokenizer.encode(TEXT * 3)
    plain = [int(t) for t, _ in generate_step(mx.array(prompt), target, max_tokens=48)]
    theirs = [
        int(t)
        for t, _, _ in speculative_generate_step(
            mx.array(prompt), target, draft, num_draft_tokens=3, max_tokens=48
        )
    ]
    ours = _solo(target, draft, prompt, SamplingOptions(), 3)
    assert _run(ours, 48) == theirs == plain
    assert ours.counters.drafted_total > 0
    # The target as its own draft agrees on every proposal: the upper bound.
    self_draft = _solo(target, target, prompt, SamplingOptions(), 4)
    assert _run(self_draft, 48) == plain
    assert self_draft.counters.accepted_total == self_draft.counters.drafted_total > 0
    # Seeded sampling draws token t with the key of (seed, t), as plain decoding does.
    options = SamplingOptions(temperature=0.9, top_p=0.95, seed=11)
    sampled = [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt), target, max_tokens=40, sampler=SeededSampler(options)
        )
    ]
    seeded = _solo(target, draft, prompt, options, 3)
    assert _run(seeded, 40) == sampled


def test_speculative_requests_give_the_plain_tokens(draft_stack: dict[str, Any]) -> None:
    with EngineClient(draft_stack["engine"].address) as engine:
        info = engine.model_info()
        assert info.draft_model_id.startswith("tandem-tiny-draft@")
        ids = engine.tokenize(TEXT * 2)
        plain = engine.generate(ids, max_tokens=40, ignore_eos=True, logprobs=2)
        spec = engine.generate(ids, max_tokens=40, ignore_eos=True, logprobs=2, num_draft_tokens=4)
        assert spec.token_ids == plain.token_ids
        assert spec.usage is not None
        assert spec.usage.draft_tokens > 0
        assert 0 <= spec.usage.accepted_draft_tokens <= spec.usage.draft_tokens
        spec_lps = [lp for c in spec.chunks for lp in c.logprobs]
        plain_lps = [lp for c in plain.chunks for lp in c.logprobs]
        assert [lp.token_id for lp in spec_lps] == spec.token_ids
        for a, b in zip(plain_lps, spec_lps, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-3
            assert [t[0] for t in a.top] == [t[0] for t in b.top]
        seeded = dict(temperature=0.8, seed=5, max_tokens=32, ignore_eos=True)
        assert (
            engine.generate(ids, num_draft_tokens=3, **seeded).token_ids
            == engine.generate(ids, **seeded).token_ids
        )
        with pytest.raises(TandemError) as err:
            engine.generate(ids, max_tokens=4, num_draft_tokens=99)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # Quantized KV rows speculate too: their rollbacks shift packed planes.
        for quantized in (dict(kv_bits=8), dict(kv_bits=3, kv_scheme="turboquant")):
            options = dict(max_tokens=24, ignore_eos=True, **quantized)
            spec = engine.generate(ids, num_draft_tokens=3, **options)
            assert spec.token_ids == engine.generate(ids, **options).token_ids, quantized


def test_no_draft_model_is_refused(engine_client: EngineClient) -> None:
    with pytest.raises(TandemError) as err:
        engine_client.generate("hello", max_tokens=4, num_draft_tokens=2)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "--draft-model" in str(err.value)


def _checkpointed_request(request_id: str) -> dict[str, Any]:
    return dict(
        max_tokens=64,
        ignore_eos=True,
        checkpoint_interval=8,
        request_id=request_id,
        num_draft_tokens=3,
    )


def _wait_for_checkpoint(store: StoreClient, tokens: int) -> Any:
    deadline = time.monotonic() + 30
    while True:
        found = store.list_all(kind="generation")
        if found and found[0].token_count >= tokens:
            return found[0]
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.05)


def _killed_mid_stream(
    draft_stack: dict[str, Any], request: dict[str, Any], chunks: list[Any] | None = None
) -> tuple[list[int], Any]:
    """Streams a speculative checkpointed generation, SIGKILLs the engine once a checkpoint
    covers most of what was read; returns (tokens received, the checkpoint's record).
    chunks: where the chunks read go."""
    store = StoreClient(f"127.0.0.1:{draft_stack['port']}")
    received: list[int] = []
    engine = EngineClient(draft_stack["engine"].address)
    for chunk in engine.stream_request(engine.request(PROMPT, **request)):
        received.extend(chunk.token_ids)
        if chunks is not None:
            chunks.append(chunk)
        if len(received) >= 30:
            break
    _wait_for_checkpoint(store, len(PROMPT) + 20)
    draft_stack["engine"].kill()
    engine.close()
    # A Put the engine finished sending just before it died may still commit: a read that
    # meets it is ABORTED (the record changed under it), and is read again.
    for _ in range(20):
        (record,) = store.list_all(kind="generation")
        try:
            checkpoint = store.get(record.key, record.namespace)
            break
        except TandemError as exc:
            if exc.code != grpc.StatusCode.ABORTED:
                raise
            time.sleep(0.1)
    store.close()
    return received, checkpoint


def test_speculative_generation_resumes_after_sigkill_with_its_draft_cache(
    draft_stack: dict[str, Any],
) -> None:
    # Asking for logprobs: the replayed tokens a resume sends come with theirs.
    request = {**_checkpointed_request("spec-1"), "logprobs": 0}
    chunks: list[Any] = []
    received, checkpoint = _killed_mid_stream(draft_stack, request, chunks)
    (attachment,) = checkpoint.attachments
    assert attachment.schema == DRAFT_SCHEMA
    assert attachment.metadata["boundary"] == str(len(checkpoint.token_ids))
    assert attachment.metadata["draft_model"].startswith("tandem-tiny-draft@")
    assert sum(t.nbytes for t in attachment.tensors) > 0
    draft_stack["engine"] = draft_stack["start_engine"]()
    with EngineClient(draft_stack["engine"].address) as engine:
        resumed = engine.generate(PROMPT, resume=True, tokens_held=len(received), **request)
        assert resumed.usage is not None
        assert resumed.usage.cached_prompt_tokens == len(PROMPT)
        # Holding 5: the tokens past them come with the values first sent (a whole snapshot's
        # pages, each written before its snapshot), replayed from the finished generation.
        engine.flush()  # its tombstone and last page are queued like any checkpoint
        again = engine.generate(PROMPT, resume=True, tokens_held=5, **request)
        plain = engine.generate(PROMPT, **{**request, "request_id": "plain", "num_draft_tokens": 0})
    assert len(plain.token_ids) == 64
    assert received + resumed.token_ids == plain.token_ids
    sent = [(lp.token_id, lp.logprob) for c in chunks for lp in c.logprobs]
    replayed = [(lp.token_id, lp.logprob) for c in again.chunks for lp in c.logprobs]
    assert len(sent) == len(received) and len(replayed) == len(again.token_ids) == 64 - 5
    checkpointed = len(checkpoint.token_ids) - len(PROMPT) + 1  # its replay, the pending too
    both = min(checkpointed, len(received))
    assert replayed[: both - 5] == sent[5:both]


def test_attachments_are_refused_off_their_boundary_codec_or_model(
    draft_stack: dict[str, Any],
) -> None:
    request = _checkpointed_request("spec-2")
    _, checkpoint = _killed_mid_stream(draft_stack, request)
    store = StoreClient(f"127.0.0.1:{draft_stack['port']}")
    (attachment,) = checkpoint.attachments
    original = dict(attachment.metadata)

    def tampered(**changes: str) -> None:
        attachment.metadata = {**original, **changes}
        store.put(checkpoint)

    draft_stack["engine"] = draft_stack["start_engine"]()
    try:
        with EngineClient(draft_stack["engine"].address) as engine:
            cases = [
                (dict(boundary=str(len(checkpoint.token_ids) - 1)), "can only be restored"),
                (dict(codec="tandem.cache.v0"), "codec"),
                (dict(draft_model="other-draft@sha256:0"), "draft_model"),
            ]
            for change, message in cases:
                tampered(**change)
                with pytest.raises(TandemError) as err:
                    engine.generate(PROMPT, resume=True, **request)
                assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, change
                assert message in str(err.value)
            # Without speculation the attachment is not needed: the target's caches resume.
            tampered()
            plain = engine.generate(PROMPT, resume=True, **{**request, "num_draft_tokens": 0})
            assert plain.finish_reason == "length"
    finally:
        store.close()
