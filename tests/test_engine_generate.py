"""Generation through a real engine process on the embedded default model."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from tandem_client import EngineClient, Generation

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over",
    "日本語の文章です",
    "def generate(prompt):",
    "a",
    "Numbers: 1 2 3 4 5 6 7 8",
    "Emoji 🙂 🚀",
    "Français : déjà vu",
]


def _mlx_lm_greedy(reference, prompt_ids: list[int], n: int) -> list[int]:  # noqa: ANN001
    out = []
    for token, _ in generate_step(mx.array(prompt_ids), reference.model, max_tokens=n):
        out.append(int(token))
    return out


def test_greedy_solo_matches_mlx_lm(engine_client: EngineClient, reference) -> None:  # noqa: ANN001
    for text in PROMPTS[:4]:
        ids = reference.tokenizer.encode(text)
        got = engine_client.generate(ids, max_tokens=40, ignore_eos=True)
        assert got.token_ids == _mlx_lm_greedy(reference, ids, 40), text
        assert got.finish_reason == "length"
        prompt_text = reference.tokenizer.decode(ids)
        full = reference.tokenizer.decode(ids + got.token_ids)
        assert full.startswith(prompt_text) and got.text == full[len(prompt_text) :]


def test_seeded_sampling_is_reproducible(engine_client: EngineClient) -> None:
    opts = dict(max_tokens=48, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    first = engine_client.generate("Hello world", **opts)
    again = engine_client.generate("Hello world", **opts)
    other = engine_client.generate("Hello world", **{**opts, "seed": 1235})
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids
    assert len(first.token_ids) == 48


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:g} s"
        time.sleep(0.02)


def _idle(client: EngineClient) -> bool:
    stats = client.stats()
    return stats.running == 0 and stats.queued == 0


def _solo_and_concurrent(
    client: EngineClient, requests: list[dict[str, Any]]
) -> tuple[list[list[int]], list[Generation], tuple[int, int]]:
    """The requests one at a time, then all at once; with the (batch steps, tokens) the
    engine counted while the concurrent ones ran (and nothing else did)."""
    solo = [client.generate(**r).token_ids for r in requests]
    _wait_for(lambda: _idle(client), "an idle engine")
    before = client.stats()
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: client.generate(**r), requests))
    generated = sum(len(g.token_ids) for g in together)

    # A step is counted just after its tokens are sent: wait for the last one's count.
    def counted() -> bool:
        return client.stats().generated_tokens_total - before.generated_tokens_total >= generated

    _wait_for(counted, "the concurrent tokens counted")
    after = client.stats()
    steps = after.steps_total - before.steps_total
    tokens = after.generated_tokens_total - before.generated_tokens_total
    return solo, together, (steps, tokens)


def test_eight_concurrent_streams_match_their_solo_runs(engine_client: EngineClient) -> None:
    requests = []
    for i, text in enumerate(PROMPTS):
        sampled = i % 2 == 1
        requests.append(
            dict(
                prompt=text,
                max_tokens=24 + 3 * i,
                ignore_eos=True,
                temperature=0.8 if sampled else 0.0,
                seed=100 + i,
            )
        )
    solo, together, (steps, tokens) = _solo_and_concurrent(engine_client, requests)
    for i, (alone, batched) in enumerate(zip(solo, together, strict=True)):
        assert len(batched.token_ids) == 24 + 3 * i
        assert batched.token_ids == alone, f"request {i} changed under batching"
    stats = engine_client.stats()
    assert stats.max_batch_size_seen >= 2
    # This test's own rows were batched: while they ran (and nothing else did), the engine
    # made their tokens in fewer steps than tokens, so some step decoded two or more of them.
    assert tokens == sum(24 + 3 * i for i in range(len(requests)))
    assert steps < tokens, (steps, tokens)


def test_logprobs_are_returned_and_consistent(engine_client: EngineClient) -> None:
    got = engine_client.generate("Hello", max_tokens=6, logprobs=3, ignore_eos=True)
    # One logprob a token, in each chunk's order. A chunk may carry several tokens: events a
    # reader has not taken yet are coalesced (front/response_stream.py), as under a loaded machine.
    chunks = [c for c in got.chunks if c.token_ids]
    assert sum(len(c.token_ids) for c in chunks) == 6
    for chunk in chunks:
        assert [lp.token_id for lp in chunk.logprobs] == list(chunk.token_ids)
    for lp in (lp for c in chunks for lp in c.logprobs):
        assert len(lp.top) == 3
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob == pytest.approx(lp.top[0][1], abs=1e-4)  # greedy takes the top


def test_chat_messages_use_the_chat_template(engine_client: EngineClient) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = engine_client.tokenize(messages=messages)
    text = engine_client.detokenize(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    via_chat = engine_client.generate(messages, max_tokens=12, ignore_eos=True)
    via_ids = engine_client.generate(ids, max_tokens=12, ignore_eos=True)
    assert via_chat.token_ids == via_ids.token_ids
    assert via_chat.usage is not None and via_chat.usage.prompt_tokens == len(ids)


def test_usage_and_model_info(engine_client: EngineClient, reference) -> None:  # noqa: ANN001
    got = engine_client.generate("Hello world", max_tokens=10, ignore_eos=True)
    u = got.usage
    assert u is not None
    assert (u.prompt_tokens, u.generated_tokens, u.cached_prompt_tokens) == (
        len(reference.tokenizer.encode("Hello world")),
        10,
        0,
    )
    assert u.ttft_seconds > 0 and u.decode_tokens_per_second > 0
    info = engine_client.model_info()
    assert info.model_id == reference.model_id and info.model_id.startswith("tandem-tiny@sha256:")
    assert list(info.layout) == ["kv:plain"] * 4
    assert info.context_length == 8192 and info.dtype == "float32"
