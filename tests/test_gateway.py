"""The gateway with real engines and a real store: the official `openai` SDK against its HTTP
front, the Tandem gRPC API through it, prefix affinity, errors, and a client that leaves."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tandem_client import EngineClient
from tests.servers import GatewayProcess, InProcessStore, ServiceProcess, run_module, start_engine

CHAT = [{"role": "user", "content": "Tell me about gateways."}]
SDK_CHAT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me about gateways."}
]


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path
) -> Iterator[tuple[GatewayProcess, list[ServiceProcess]]]:
    root = tmp_path_factory.mktemp("gateway")
    store = InProcessStore(root / "store")
    engines: list[ServiceProcess] = []
    gateway = None
    try:
        for i in range(2):
            engines.append(
                start_engine(engine_data_dir, "--store", store.address, log_dir=root / f"e{i}")
            )
        gateway = GatewayProcess(
            [e.address for e in engines], root / "gateway.log", "--poll-interval", "0.2"
        )
        gateway.wait_engines(2)
        yield gateway, engines
    finally:
        if gateway is not None:
            gateway.stop()
        for e in engines:
            e.stop()
        store.stop()


@pytest.fixture(scope="module")
def sdk(cluster: tuple[GatewayProcess, list[ServiceProcess]]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=cluster[0].http + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _engine_stats(engines: list[ServiceProcess]) -> list[Any]:
    out = []
    for e in engines:
        with EngineClient(e.address) as c:
            out.append(c.stats())
    return out


def test_models_and_health(
    cluster: tuple[GatewayProcess, list[ServiceProcess]], sdk: openai.OpenAI
) -> None:
    assert [m.id for m in sdk.models.list()] == ["tandem-tiny"]
    with urllib.request.urlopen(cluster[0].http + "/health") as reply:
        assert json.load(reply) == {"status": "ok", "engines": {"serving": 2, "total": 2}}


def test_chat_completion_equals_the_engine_for_the_same_seed(
    cluster: tuple[GatewayProcess, list[ServiceProcess]], sdk: openai.OpenAI
) -> None:
    with EngineClient(cluster[1][0].address) as direct:
        expected = direct.generate(CHAT, max_tokens=24, temperature=0.8, seed=42).text
    reply = sdk.chat.completions.create(
        model="tandem-tiny", messages=SDK_CHAT, max_tokens=24, temperature=0.8, seed=42
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 24

    stream = sdk.chat.completions.create(
        model="tandem-tiny",
        messages=SDK_CHAT,
        max_tokens=24,
        temperature=0.8,
        seed=42,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24


def test_completion_equals_tandem_generate(
    cluster: tuple[GatewayProcess, list[ServiceProcess]], sdk: openai.OpenAI
) -> None:
    cli = run_module(
        "tandem_client.cli",
        "generate",
        "Once upon a time",
        "--engine",
        cluster[1][1].address,
        "--max-tokens",
        "20",
        "--temperature",
        "0.7",
        "--seed",
        "9",
        "--json",
    )
    assert cli.returncode == 0, cli.stderr
    expected = json.loads(cli.stdout)
    reply = sdk.completions.create(
        model="tandem-tiny",
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0.7,
        seed=9,
        logprobs=2,
    )
    choice = reply.choices[0]
    assert choice.text == expected["text"]
    assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 20
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs or [])
    # Token ids as the prompt, streamed.
    ids = expected["token_ids"][:5]
    streamed = sdk.completions.create(
        model="tandem-tiny", prompt=ids, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    with EngineClient(cluster[1][0].address) as direct:
        assert text == direct.generate(ids, max_tokens=6).text


def test_grpc_through_the_gateway_gives_the_engines_tokens(
    cluster: tuple[GatewayProcess, list[ServiceProcess]],
) -> None:
    gateway, engines = cluster
    with EngineClient(engines[0].address) as direct, EngineClient(gateway.grpc) as proxied:
        for seed in (1, 2):
            want = direct.generate(CHAT, max_tokens=16, temperature=0.9, seed=seed)
            got = proxied.generate(CHAT, max_tokens=16, temperature=0.9, seed=seed)
            assert got.token_ids == want.token_ids and got.text == want.text
            assert got.usage is not None and got.usage.failovers == 0
        assert proxied.model_info().model_id == direct.model_info().model_id
        assert proxied.tokenize("hello world") == direct.tokenize("hello world")
        assert proxied.stats().requests_total >= 2


def test_errors_come_back_in_openai_shape(
    cluster: tuple[GatewayProcess, list[ServiceProcess]], sdk: openai.OpenAI
) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.chat.completions.create(model="no-such-model", messages=SDK_CHAT, max_tokens=4)
    assert "no-such-model" in str(missing.value)
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model="tandem-tiny", prompt="x", max_tokens=4, temperature=7)
    assert bad.value.body is not None and "temperature" in str(bad.value.body)
    with pytest.raises(openai.BadRequestError):  # n is 1..16 (test_openai_surface.py)
        sdk.chat.completions.create(model="tandem-tiny", messages=SDK_CHAT, n=17)
    with pytest.raises(openai.BadRequestError) as refused:  # the engine's refusal, mapped
        sdk.completions.create(model="tandem-tiny", prompt=[10_000_000], max_tokens=4)
    assert "unknown token id" in str(refused.value)
    request = urllib.request.Request(
        cluster[0].http + "/v1/completions", data=b"{not json", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request)
    assert raw.value.code == 400
    assert json.load(raw.value)["error"]["type"] == "invalid_request_error"


def test_response_format_constrains_the_output(sdk: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "rank": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    for seed in range(3):
        reply = sdk.chat.completions.create(
            model="tandem-tiny",
            messages=SDK_CHAT,
            max_tokens=80,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": schema, "strict": True},
            },
        )
        content = reply.choices[0].message.content or ""
        assert reply.choices[0].finish_reason == "stop", content
        jsonschema.validate(json.loads(content), schema)
    picked = sdk.completions.create(
        model="tandem-tiny",
        prompt="Pick one:",
        max_tokens=8,
        extra_body={"tandem": {"choice": ["north", "south"]}},
    )
    assert picked.choices[0].text in ("north", "south")
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(
            model="tandem-tiny",
            messages=SDK_CHAT,
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        )
    assert "nonsense" in str(bad.value)
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(
            model="tandem-tiny", messages=SDK_CHAT, extra_body={"response_format": {"type": "yaml"}}
        )


def test_a_shared_prefix_lands_on_the_engine_that_holds_it(
    cluster: tuple[GatewayProcess, list[ServiceProcess]],
) -> None:
    gateway, engines = cluster
    prefix = [(i * 37) % 900 + 20 for i in range(192)]
    before = _engine_stats(engines)
    with EngineClient(gateway.grpc) as proxied:
        proxied.generate(prefix + [5, 6, 7], max_tokens=4)
        middle = _engine_stats(engines)
        served = [m.requests_total - b.requests_total for m, b in zip(middle, before, strict=True)]
        first = served.index(1)
        second = proxied.generate(prefix + [8, 9], max_tokens=4)
    after = _engine_stats(engines)
    assert after[first].requests_total == middle[first].requests_total + 1
    assert second.usage is not None and second.usage.cached_prompt_tokens >= 176
    hits = after[first].checkpoints.prefix_hits_local - middle[first].checkpoints.prefix_hits_local
    assert hits == 1


def test_a_client_that_leaves_cancels_its_generation(
    cluster: tuple[GatewayProcess, list[ServiceProcess]],
) -> None:
    gateway, engines = cluster
    before = sum(s.cancelled_total for s in _engine_stats(engines))
    body = json.dumps(
        {
            "model": "tandem-tiny",
            "prompt": "Go on",
            "max_tokens": 4000,
            "stream": True,
            "tandem": {"ignore_eos": True},
        }
    ).encode()
    request = urllib.request.Request(gateway.http + "/v1/completions", data=body, method="POST")
    reply = urllib.request.urlopen(request)
    for _ in range(3):
        assert reply.readline().startswith(b"data: ")
        reply.readline()
    reply.close()
    deadline = time.monotonic() + 30
    while True:
        stats = _engine_stats(engines)
        if sum(s.cancelled_total for s in stats) > before and not any(s.running for s in stats):
            break
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.1)


def test_engines_come_and_go_through_the_engines_file(
    cluster: tuple[GatewayProcess, list[ServiceProcess]], tmp_path: Path
) -> None:
    engines = cluster[1]
    listed = tmp_path / "engines.txt"
    listed.write_text(f"{engines[0].address}  # the first\n")
    gateway = GatewayProcess(
        [], tmp_path / "gateway.log", "--engines-file", str(listed), "--poll-interval", "0.1"
    )
    try:
        gateway.wait_engines(1)
        listed.write_text(f"{engines[0].address}\n{engines[1].address}\n")
        gateway.wait_engines(2)
        listed.write_text(f"# only the second now\n{engines[1].address}\n")
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(gateway.http + "/health") as reply:
                if json.load(reply)["engines"] == {"serving": 1, "total": 1}:
                    break
            assert time.monotonic() < deadline, "the removed engine stayed"
            time.sleep(0.05)
        with EngineClient(gateway.grpc) as client:
            assert client.generate("hi", max_tokens=3).usage is not None
    finally:
        gateway.stop()
