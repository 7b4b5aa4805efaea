"""The OpenAI surface's strictness and shape (issue 36, first part): every field of the SDK's
request types placed (honoured, refused by name, or ignored by design), OpenAI's stream
layout, `text_offset`, `models.retrieve`, tokenize/detokenize, llama.cpp's `grammar` and
`json_schema`, and CORS only by flag. Real engine and gateway processes, the `openai` SDK."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletionMessageParam
from openai.types.chat import completion_create_params as chat_params
from openai.types.responses import response_create_params as responses_params

from gateway_service import openai_responses as responses
from gateway_service.openai_errors import ApiError
from gateway_service.openai_fields import HONOURED, IGNORED, REFUSED, Endpoint, check_fields
from tandem_client import EngineClient
from tests.servers import GatewayProcess, ServiceProcess, start_engine, start_store

ORIGIN = "https://app.example"
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]


def _sdk_fields(params: Any) -> set[str]:
    fields: set[str] = set()
    for kind in (params.CompletionCreateParamsStreaming, params.CompletionCreateParamsNonStreaming):
        for klass in kind.__mro__:
            fields |= set(getattr(klass, "__annotations__", {}))
    return fields


@pytest.mark.parametrize(
    ("endpoint", "params"),
    [(Endpoint.CHAT, chat_params), (Endpoint.COMPLETIONS, completion_params)],
)
def test_every_field_the_sdk_sends_is_placed(endpoint: Endpoint, params: Any) -> None:
    """A field a new `openai` release adds fails here until it is honoured, refused or listed
    as ignored by design (gateway_service/openai_fields.py and docs/gateway.md)."""
    placed = HONOURED[endpoint] | set(IGNORED) | set(REFUSED)
    assert _sdk_fields(params) - placed == set()


def test_every_responses_field_the_sdk_sends_is_placed() -> None:
    fields: set[str] = set()
    for kind in (
        responses_params.ResponseCreateParamsStreaming,
        responses_params.ResponseCreateParamsNonStreaming,
    ):
        for klass in kind.__mro__:
            fields |= set(getattr(klass, "__annotations__", {}))
    placed = responses.HONOURED | set(responses.IGNORED) | set(responses.REFUSED)
    assert fields - placed == set()
    for name, refused in responses.REFUSED.items():
        for neutral in refused.neutral:
            responses.check_response_fields({"input": "x", name: neutral}, False)
        with pytest.raises(ApiError) as named:
            responses.check_response_fields({"input": "x", name: "not neutral"}, False)
        assert named.value.param == name
    # A gateway with --store keeps conversations: previous_response_id and store honoured.
    kept = {"input": "x", "previous_response_id": "resp_1", "store": True}
    responses.check_response_fields(kept, True)
    with pytest.raises(ApiError) as stateless:
        responses.check_response_fields(kept, False)
    assert stateless.value.param == "previous_response_id"


def test_each_refused_field_is_named_and_its_neutral_value_accepted() -> None:
    non_neutral: dict[str, Any] = {
        "best_of": 3,
        "echo": True,
        "suffix": "end",
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "functions": [{"name": "f"}],
        "tool_choice": "required",
        "function_call": {"name": "f"},
        "parallel_tool_calls": "yes",
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
        "reasoning_effort": "high",
        "verbosity": "low",
        "web_search_options": {},
        "moderation": {"mode": "strict"},
    }
    assert set(non_neutral) == set(REFUSED)
    for name, value in non_neutral.items():
        # Refused where it is not honoured: tools on completions, echo on chat.
        where = Endpoint.COMPLETIONS if name in HONOURED[Endpoint.CHAT] else Endpoint.CHAT
        with pytest.raises(ApiError) as refused:
            check_fields({"model": "m", name: value}, where)
        assert refused.value.status == 400 and refused.value.param == name, name
        for neutral in REFUSED[name].neutral:
            check_fields({"model": "m", name: neutral}, where)
    for name in IGNORED:
        check_fields({"model": "m", name: "anything"}, Endpoint.CHAT)
    with pytest.raises(ApiError) as unknown:
        check_fields({"model": "m", "temprature": 0.5}, Endpoint.CHAT)
    assert unknown.value.param == "temprature" and "unknown field" in str(unknown.value)
    with pytest.raises(ApiError) as chat_only:
        check_fields({"prompt": "x", "messages": []}, Endpoint.COMPLETIONS)
    assert chat_only.value.param == "messages"
    with pytest.raises(ApiError) as options:
        check_fields({"stream_options": {"include_usage": True}}, Endpoint.CHAT)
    assert options.value.param == "stream_options"


@pytest.fixture(scope="module")
def gateways(
    tmp_path_factory: pytest.TempPathFactory, engine: ServiceProcess
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """Two gateways on the session's engine: with `--cors-origin ORIGIN`, and without."""
    root = tmp_path_factory.mktemp("openai-surface")
    with_cors = GatewayProcess([engine.address], root / "cors.log", "--cors-origin", ORIGIN)
    plain = GatewayProcess([engine.address], root / "plain.log")
    try:
        with_cors.wait_engines(1)
        plain.wait_engines(1)
        yield with_cors, plain
    finally:
        with_cors.stop()
        plain.stop()


def _request(
    base: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    address = urlsplit(base)
    conn = http.client.HTTPConnection(address.hostname or "", address.port, timeout=60)
    try:
        data = None if body is None else json.dumps(body)
        sent = {"content-type": "application/json", **(headers or {})}
        conn.request(method, path, data, sent)
        reply = conn.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    finally:
        conn.close()


def _events(raw: bytes) -> list[Any]:
    lines = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_a_chat_stream_has_openai_s_layout(gateways: tuple[GatewayProcess, ...]) -> None:
    body = {
        "model": "tandem-tiny",
        "messages": CHAT,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tandem": {"ignore_eos": True},
    }
    status, _, raw = _request(gateways[1].http, "POST", "/v1/chat/completions", body)
    assert status == 200
    events = _events(raw)
    assert events[-1] == "[DONE]"
    opening, *content, finish, usage = events[:-1]
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert opening["choices"][0]["finish_reason"] is None
    assert content and all(set(c["choices"][0]["delta"]) == {"content"} for c in content)
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert finish["tandem"]["tokens_held"] == 6  # what a resume would send
    with openai.OpenAI(base_url=gateways[1].http + "/v1", api_key="x", max_retries=0) as sdk:
        whole = sdk.chat.completions.create(
            model="tandem-tiny",
            messages=CHAT,
            max_tokens=6,
            seed=3,
            extra_body={"tandem": {"ignore_eos": True}},
        )
        streamed = sdk.chat.completions.create(
            model="tandem-tiny",
            messages=CHAT,
            max_tokens=6,
            seed=3,
            stream=True,
            extra_body={"tandem": {"ignore_eos": True}},
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content


def test_completion_logprobs_carry_text_offsets(gateways: tuple[GatewayProcess, ...]) -> None:
    with openai.OpenAI(base_url=gateways[1].http + "/v1", api_key="x", max_retries=0) as sdk:
        reply = sdk.completions.create(
            model="tandem-tiny", prompt="Hello", max_tokens=8, logprobs=2, seed=1
        )
        streamed = list(
            sdk.completions.create(
                model="tandem-tiny", prompt="Hello", max_tokens=8, logprobs=2, seed=1, stream=True
            )
        )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.text_offset
    starts = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == starts
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [o for p in pieces for o in (p.text_offset or [])] == starts  # continued across chunks
    assert streamed[-1].choices[0].text == "" and streamed[-1].choices[0].finish_reason == "length"


def test_models_retrieve_and_an_unknown_model(gateways: tuple[GatewayProcess, ...]) -> None:
    with openai.OpenAI(base_url=gateways[1].http + "/v1", api_key="x", max_retries=0) as sdk:
        model = sdk.models.retrieve("tandem-tiny")
        assert model.id == "tandem-tiny" and model.object == "model" and model.created > 0
        with pytest.raises(openai.NotFoundError) as missing:
            sdk.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"


def test_tokenize_and_detokenize_agree_with_the_engine(
    gateways: tuple[GatewayProcess, ...], engine: ServiceProcess
) -> None:
    base = gateways[1].http
    status, _, raw = _request(base, "POST", "/tokenize", {"prompt": "Hello there"})
    assert status == 200
    got = json.loads(raw)
    with EngineClient(engine.address) as client:
        assert got["tokens"] == client.tokenize("Hello there", add_special_tokens=True)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] > 0
    status, _, raw = _request(base, "POST", "/tokenize", {"messages": CHAT})
    assert status == 200 and json.loads(raw)["count"] > 3  # the chat template's tokens too
    plain = json.loads(
        _request(base, "POST", "/tokenize", {"prompt": "Hello there", "add_special_tokens": False})[
            2
        ]
    )
    status, _, raw = _request(base, "POST", "/detokenize", {"tokens": plain["tokens"]})
    assert status == 200 and json.loads(raw)["prompt"] == "Hello there"
    status, _, raw = _request(base, "POST", "/detokenize", {"tokens": ["a"]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "tokens"
    status, _, raw = _request(base, "POST", "/tokenize", {"prompt": "x", "extra": 1})
    assert status == 400 and json.loads(raw)["error"]["param"] == "extra"


def test_llama_cpp_grammar_and_json_schema(gateways: tuple[GatewayProcess, ...]) -> None:
    base = gateways[1].http
    common = {"model": "tandem-tiny", "prompt": "Answer:", "max_tokens": 12, "seed": 5}
    grammar = 'root ::= "yes" | "no"'
    status, _, raw = _request(base, "POST", "/v1/completions", {**common, "grammar": grammar})
    assert status == 200 and json.loads(raw)["choices"][0]["text"] in ("yes", "no")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    body = {**common, "max_tokens": 24, "json_schema": schema}
    status, _, raw = _request(base, "POST", "/v1/completions", body)
    assert status == 200
    assert set(json.loads(json.loads(raw)["choices"][0]["text"])) == {"ok"}
    both = {**common, "grammar": grammar, "json_schema": schema}
    status, _, raw = _request(base, "POST", "/v1/completions", both)
    assert status == 400 and "one constraint at most" in json.loads(raw)["error"]["message"]


def test_fields_that_were_silently_ignored_are_refused_by_name(
    gateways: tuple[GatewayProcess, ...],
) -> None:
    with openai.OpenAI(base_url=gateways[1].http + "/v1", api_key="x", max_retries=0) as sdk:
        # Tools reach the engine, which refuses them for a model with no tool-call format.
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        with pytest.raises(openai.BadRequestError) as no_format:
            sdk.chat.completions.create(
                model="tandem-tiny", messages=CHAT, max_tokens=2, extra_body={"tools": tools}
            )
        assert "no tool-call format" in str(no_format.value)
        for extra in (
            {"reasoning_effort": "high"},
            {"modalities": ["audio"]},
            {"not_a_field": 1},
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                sdk.chat.completions.create(
                    model="tandem-tiny",
                    messages=CHAT,
                    max_tokens=2,
                    extra_body=extra,
                )
            assert refused.value.param == next(iter(extra)), extra
        with pytest.raises(openai.BadRequestError) as options:
            sdk.completions.create(
                model="tandem-tiny",
                prompt="hi",
                max_tokens=2,
                stream_options={"include_usage": True},
            )
        assert options.value.param == "stream_options"
        kept = sdk.chat.completions.create(
            model="tandem-tiny",
            messages=CHAT,
            max_tokens=2,
            user="u-1",
            service_tier="auto",
            metadata={"k": "v"},
        )
        assert kept.usage is not None and kept.usage.completion_tokens <= 2


def test_cors_only_for_the_named_origins(gateways: tuple[GatewayProcess, ...]) -> None:
    with_cors, plain = gateways
    preflight = {
        "origin": ORIGIN,
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    status, headers, _ = _request(
        with_cors.http, "OPTIONS", "/v1/chat/completions", None, preflight
    )
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    other = {**preflight, "origin": "https://elsewhere.example"}
    status, headers, _ = _request(with_cors.http, "OPTIONS", "/v1/chat/completions", None, other)
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers, _ = _request(with_cors.http, "GET", "/v1/models", None, {"origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    # Without --cors-origin: no CORS headers at all, so a browser keeps the page out.
    status, headers, _ = _request(plain.http, "OPTIONS", "/v1/chat/completions", None, preflight)
    assert status == 405 and "access-control-allow-origin" not in headers
    status, headers, _ = _request(plain.http, "GET", "/v1/models", None, {"origin": ORIGIN})
    assert status == 200 and "access-control-allow-origin" not in headers


def test_the_cors_flag_takes_origins_only(tmp_path: Path) -> None:
    from gateway_service.config import parse_args

    config = parse_args(["--engine", "e:1", "--http-listen", "127.0.0.1:0", "--cors-origin", "*"])
    assert config.cors_origins == ["*"]
    with pytest.raises(SystemExit):
        parse_args(["--engine", "e:1", "--http-listen", ":0", "--cors-origin", "app.example"])


@pytest.fixture(scope="module")
def stored(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path
) -> Iterator[tuple[GatewayProcess, ServiceProcess]]:
    """A gateway on an engine with a store (its prefixes are cached and reused)."""
    root = tmp_path_factory.mktemp("choices")
    store = start_store(root / "store")
    engine = start_engine(engine_data_dir, "--store", store.address, log_dir=root)
    gateway = GatewayProcess([engine.address], root / "gateway.log")
    try:
        gateway.wait_engines(1)
        yield gateway, engine
    finally:
        gateway.stop()
        engine.stop()
        store.stop()


def test_n_choices_prefill_once_and_stream_with_their_index(
    stored: tuple[GatewayProcess, ServiceProcess],
) -> None:
    gateway, engine = stored
    prompt = "Once upon a time, in a land of many engines, " * 8
    common: dict[str, Any] = dict(
        model="tandem-tiny", prompt=prompt, max_tokens=10, seed=21, temperature=1.0
    )
    extra = {"tandem": {"ignore_eos": True}}
    with (
        openai.OpenAI(base_url=gateway.http + "/v1", api_key="x", max_retries=0) as sdk,
        EngineClient(engine.address) as direct,
    ):
        hits = direct.stats().checkpoints.prefix_hits_local
        three = sdk.completions.create(**common, n=3, extra_body=extra)
        assert direct.stats().checkpoints.prefix_hits_local == hits + 2  # one prefill
        assert [c.index for c in three.choices] == [0, 1, 2]
        texts = [c.text for c in three.choices]
        assert len(set(texts)) > 1  # each choice its own seed
        assert three.usage is not None and three.usage.completion_tokens == 30
        one = sdk.completions.create(**common, extra_body=extra)
        assert one.choices[0].text == texts[0]  # choice 0 is the request itself

        streamed: dict[int, str] = {0: "", 1: "", 2: ""}
        finishes: dict[int, str | None] = {}
        chunks = sdk.completions.create(
            **common, n=3, stream=True, stream_options={"include_usage": True}, extra_body=extra
        )
        for chunk in chunks:
            for choice in chunk.choices:
                streamed[choice.index] += choice.text
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
            if chunk.usage is not None:
                assert chunk.usage.completion_tokens == 30
        assert [streamed[i] for i in range(3)] == texts  # the same seeds, the same text
        assert finishes == {0: "length", 1: "length", 2: "length"}

        chat = sdk.chat.completions.create(
            model="tandem-tiny", messages=CHAT, max_tokens=4, n=2, seed=3, extra_body=extra
        )
        assert [c.index for c in chat.choices] == [0, 1]
        for bad in (0, 17, True):
            with pytest.raises(openai.BadRequestError) as refused:
                sdk.completions.create(**{**common, "n": bad})
            assert refused.value.param == "n"


def test_echo_gives_the_prompt_back_first(
    gateways: tuple[GatewayProcess, ...], engine: ServiceProcess
) -> None:
    common: dict[str, Any] = dict(model="tandem-tiny", max_tokens=6, seed=8)
    extra = {"tandem": {"ignore_eos": True}}
    with (
        openai.OpenAI(base_url=gateways[1].http + "/v1", api_key="x", max_retries=0) as sdk,
        EngineClient(engine.address) as direct,
    ):
        plain = sdk.completions.create(prompt="Hello there", **common, extra_body=extra)
        echoed = sdk.completions.create(prompt="Hello there", echo=True, **common, extra_body=extra)
        assert echoed.choices[0].text == "Hello there" + plain.choices[0].text
        chunks = list(
            sdk.completions.create(
                prompt="Hello there", echo=True, stream=True, **common, extra_body=extra
            )
        )
        assert chunks[0].choices[0].text == "Hello there"
        assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
        ids = direct.tokenize("Hello there", add_special_tokens=False)
        by_ids = sdk.completions.create(prompt=ids, echo=True, **common, extra_body=extra)
        assert by_ids.choices[0].text.startswith(direct.detokenize(ids))
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.completions.create(prompt="Hi", echo=True, logprobs=1, **common)
        assert refused.value.param == "echo"
