"""OpenAI's presence and frequency penalties and logit_bias (issue 36): through a real engine
they give mlx-lm's own tokens with mlx-lm's own processors, a checkpointed generation with
them resumes exactly after SIGKILL, and the gateway passes them as OpenAI names them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from tandem_client import EngineClient, StoreClient, TandemError
from tests.servers import (
    GatewayProcess,
    ServiceProcess,
    free_port,
    kill_after_checkpoint,
    resume_equals_uninterrupted,
    start_engine,
    start_store_on,
)

PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def _mlx_lm(reference: Any, ids: list[int], n: int, **processors: Any) -> list[int]:
    chain = make_logits_processors(**processors)
    steps = generate_step(mx.array(ids), reference.model, max_tokens=n, logits_processors=chain)
    return [int(token) for token, _ in steps]


def test_penalties_and_bias_give_mlx_lm_s_tokens(
    engine_client: EngineClient,
    reference: Any,  # noqa: ANN401
) -> None:
    ids = reference.tokenizer.encode(PROMPT_TEXT)
    plain = engine_client.generate(ids, max_tokens=32, ignore_eos=True).token_ids
    bias = {plain[0]: -100.0, plain[3]: 2.5}
    options = dict(presence_penalty=1.5, frequency_penalty=0.8, logit_bias=bias)
    got = engine_client.generate(ids, max_tokens=32, ignore_eos=True, **options)
    want = _mlx_lm(
        reference,
        ids,
        32,
        logit_bias=bias,
        presence_penalty=1.5,
        presence_context_size=20,
        frequency_penalty=0.8,
        frequency_context_size=20,
    )
    assert got.token_ids == want
    assert got.token_ids != plain and got.token_ids[0] != plain[0]  # the options took effect
    forced = engine_client.generate(ids, max_tokens=6, ignore_eos=True, logit_bias={7: 100.0})
    assert forced.token_ids == [7] * 6


def test_bad_penalties_and_biases_are_invalid_argument(engine_client: EngineClient) -> None:
    vocab = engine_client.model_info().vocab_size
    for options in (
        {"logit_bias": {vocab + 5: 1.0}},
        {"logit_bias": {3: float("inf")}},
        {"logit_bias": {i: 1.0 for i in range(1025)}},
        {"presence_penalty": float("nan")},
        {"frequency_penalty": float("-inf")},
    ):
        with pytest.raises(TandemError) as refused:
            engine_client.generate("hi", max_tokens=2, **options)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, options


@pytest.fixture
def store_engine(tmp_path: Path, engine_data_dir: Path) -> Iterator[tuple[ServiceProcess, int]]:
    port = free_port()
    store = start_store_on(tmp_path / "store", port)
    engine = start_engine(engine_data_dir, "--store", f"127.0.0.1:{port}", log_dir=tmp_path)
    try:
        yield engine, port
    finally:
        engine.stop()
        store.stop()


def test_a_penalised_generation_resumes_exactly_after_sigkill(
    store_engine: tuple[ServiceProcess, int], engine_data_dir: Path, tmp_path: Path
) -> None:
    engine, port = store_engine
    prompt = [(i * 37) % 1500 + 3 for i in range(90)]
    request: dict[str, Any] = dict(
        max_tokens=48,
        ignore_eos=True,
        checkpoint_interval=8,
        request_id="penalised-1",
        temperature=0.9,
        seed=11,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        logit_bias={5: 3.0, 9: -2.0},
    )
    with StoreClient(f"127.0.0.1:{port}") as store:
        received, _ = kill_after_checkpoint(engine, store, prompt, request, 20, 16)
    fresh = start_engine(engine_data_dir, "--store", f"127.0.0.1:{port}", log_dir=tmp_path)
    try:
        with EngineClient(fresh.address) as client:  # other penalties: another generation
            with pytest.raises(TandemError) as other:
                client.generate(prompt, resume=True, **{**request, "presence_penalty": 0.1})
            assert other.value.code in (
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        resume_equals_uninterrupted(fresh.address, prompt, request, received)
    finally:
        fresh.stop()


def test_the_gateway_passes_openai_s_names(engine: ServiceProcess, tmp_path: Path) -> None:
    gateway = GatewayProcess([engine.address], tmp_path / "gateway.log")
    try:
        gateway.wait_engines(1)
        with (
            openai.OpenAI(base_url=gateway.http + "/v1", api_key="x", max_retries=0) as sdk,
            EngineClient(engine.address) as direct,
        ):
            forced = sdk.completions.create(
                model="tandem-tiny",
                prompt=PROMPT_TEXT,
                max_tokens=4,
                temperature=0,
                logit_bias={"7": 250},  # clamped to 100, as OpenAI does
                extra_body={"tandem": {"ignore_eos": True}},
            )
            assert forced.usage is not None and forced.usage.completion_tokens == 4
            want = direct.generate(PROMPT_TEXT, max_tokens=4, ignore_eos=True, logit_bias={7: 100})
            assert forced.choices[0].text == want.text
            penalised = sdk.completions.create(
                model="tandem-tiny",
                prompt=PROMPT_TEXT,
                max_tokens=16,
                temperature=0,
                presence_penalty=1.5,
                frequency_penalty=0.8,
                extra_body={"tandem": {"ignore_eos": True}},
            )
            want = direct.generate(
                PROMPT_TEXT,
                max_tokens=16,
                ignore_eos=True,
                presence_penalty=1.5,
                frequency_penalty=0.8,
            )
            assert penalised.choices[0].text == want.text
            for bad in ({"presence_penalty": 2.5}, {"logit_bias": {"x": 1}}):
                with pytest.raises(openai.BadRequestError):
                    sdk.completions.create(
                        model="tandem-tiny", prompt="hi", max_tokens=2, extra_body=bad
                    )
    finally:
        gateway.stop()
