"""Tool calling and the Responses API (issue 36): the split that cuts calls out of an answer,
in-process; then a tiny model whose template takes tools (tests/tool_model.py) through real
engines and a gateway, spoken to with the engine's gRPC client, the `openai` SDK (sync, async,
streaming, chat.completions and responses) and LangChain; and a forced call SIGKILLed
mid-arguments and resumed on another engine."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from engine_service.front.tool_calls import ToolCallDelta, ToolCallSplit
from engine_service.front.tools import ChoiceMode, ToolFormat, ToolSpec, ToolUse, call_id
from tandem_client import EngineClient, TandemError
from tests.servers import GatewayProcess, InProcessStore, ServiceProcess, start_engine
from tests.tool_model import CALL_TEXT, WHOLE_CALL, build_tool_model

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "note": {"type": "string", "maxLength": 40},
    },
    "required": ["city", "note"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 8}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
# The Responses API's shape of the same tools: the function's fields beside "type".
FLAT_TOOLS: Any = [{"type": "function", **t["function"]} for t in TOOLS]
CHAT: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED: dict[str, Any] = dict(tools=TOOLS, tool_choice="get_weather", max_tokens=160)
MODEL = "tandem-tiny-tools"


# -- the split, in-process ------------------------------------------------------------------


def _split(json_body: bool = True) -> ToolCallSplit:
    def parse(text: str, tools: Any) -> Any:
        return json.loads(text.strip())

    fmt = ToolFormat("<tool_call>", "</tool_call>", parse, json_body)
    use = ToolUse((ToolSpec("f", "", {}),), ChoiceMode.AUTO, "", True)
    return ToolCallSplit(fmt, use, "req-1")


def _fed(split: ToolCallSplit, pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    content, calls = "", []
    for piece in [*pieces, None]:
        part = split.add(piece) if piece is not None else split.finish()
        content += part.content
        calls += part.calls
    return content, calls


def _whole(calls: list[ToolCallDelta]) -> dict[int, tuple[str, str, str]]:
    out: dict[int, tuple[str, str, str]] = {}
    for d in calls:
        cid, name, arguments = out.get(d.index, ("", "", ""))
        out[d.index] = (cid or d.id, name or d.name, arguments + d.arguments)
    return out


def test_a_json_call_streams_its_name_then_its_arguments_in_pieces() -> None:
    call = '{"name": "f", "arguments": {"a": {"b": [1, 2]}, "c": "}"}}'
    text = f"Sure. <tool_call>\n{call}\n</tool_call>\n"
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    content, calls = _fed(_split(), pieces)
    assert content == "Sure. "  # the newline after the call is layout
    assert calls[0] == ToolCallDelta(0, call_id("req-1", 0), "f", "")
    assert all(not d.id and d.arguments for d in calls[1:])  # the name once, then pieces
    assert len(calls) > 5
    arguments = _whole(calls)[0][2]
    assert json.loads(arguments) == {"a": {"b": [1, 2]}, "c": "}"}


def test_other_layouts_parse_whole_and_what_does_not_parse_stays_content() -> None:
    # Arguments first: not streamable, parsed at the end marker by the format's parser.
    content, calls = _fed(
        _split(), ['<tool_call>{"arguments": {"x": 1},', ' "name": "f"}</tool_call>']
    )
    assert (content, _whole(calls)) == ("", {0: (call_id("req-1", 0), "f", '{"x": 1}')})
    # A non-JSON format is never streamed; two calls, the whitespace between them dropped.
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, calls = _fed(_split(json_body=False), [call, "\n\n", call, " done"])
    assert content == " done" and len(_whole(calls)) == 2
    # Not a call: the text is the answer's, markers and all.
    content, calls = _fed(_split(json_body=False), ["a <tool_call>not json</tool_call> b"])
    assert (content, calls) == ("a <tool_call>not json</tool_call> b", [])
    # A name with a malformed escape is not streamed; mlx-lm's parser refuses it whole.
    content, calls = _fed(_split(), ['<tool_call>{"name": "\\x", "arguments": {}}</tool_call>'])
    assert calls == [] and content.startswith("<tool_call>")
    # A marker split across pieces, and one that never completes.
    content, calls = _fed(_split(), ["x <tool_", "call>", '{"name": "f", "arguments": {}}'])
    assert content == "x " and _whole(calls)[0][1:] == ("f", "{}")
    assert _fed(_split(), ["x <tool_ca"]) == ("x <tool_ca", [])


def test_a_resumed_split_sends_the_same_pieces() -> None:
    """Fed the same text in other pieces (an engine that resumes replays the held tokens
    through the split), the calls come out the same, ids included."""
    text = f"{CALL_TEXT}\n{CALL_TEXT}"
    one = _whole(_fed(_split(), [text])[1])
    many = _whole(_fed(_split(), list(text))[1])
    assert one == many and len(one) == 2 and one[0][0] != one[1][0]


# -- engines and a gateway ------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path
) -> Iterator[tuple[list[ServiceProcess], GatewayProcess]]:
    root = tmp_path_factory.mktemp("tools")
    model = build_tool_model(root / MODEL)
    store = InProcessStore(root / "store")
    engines: list[ServiceProcess] = []
    gateway = None
    try:
        for i in range(2):
            engines.append(
                start_engine(
                    engine_data_dir,
                    "--model",
                    str(model),
                    "--store",
                    store.address,
                    log_dir=root / f"e{i}",
                )
            )
        gateway = GatewayProcess(
            [e.address for e in engines],
            root / "gateway.log",
            "--store",  # /v1/responses keeps conversations there
            store.address,
            "--checkpoint-interval",
            "4",
            "--poll-interval",
            "0.2",
        )
        gateway.wait_engines(2)
        yield engines, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        for e in engines:
            e.stop()
        store.stop()


def _sdk(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.http + "/v1", api_key="x", max_retries=0)


def _valid(name: str, arguments: str) -> dict[str, Any]:
    parsed = json.loads(arguments)
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
    jsonschema.validate(parsed, schema)
    return dict(parsed)


def test_grpc_forced_auto_and_none(cluster: tuple[list[ServiceProcess], GatewayProcess]) -> None:
    engines, _ = cluster
    with EngineClient(engines[0].address) as client:
        plain = client.tokenize(messages=CHAT)
        assert len(client.tokenize(messages=CHAT, tools=TOOLS)) > len(plain) + 40  # rendered
        forced = client.generate(CHAT, **FORCED, parallel_tool_calls=False, request_id="g-1")
        (call,) = forced.tool_calls
        assert (forced.text, forced.finish_reason, call.name) == ("", "stop", "get_weather")
        assert call.id == call_id("g-1", 0)
        _valid(call.name, call.arguments)
        # Auto: the model's own call (the whole-call token, biased) is parsed, not text.
        auto = client.generate(CHAT, tools=TOOLS, logit_bias={WHOLE_CALL: 100.0}, max_tokens=1)
        assert auto.text == "" and [(c.name, c.arguments) for c in auto.tool_calls] == [
            ("get_weather", '{"city": "Paris"}')
        ]
        # None: the tools are shown, nothing is parsed.
        shown = client.generate(
            CHAT, tools=TOOLS, tool_choice="none", logit_bias={WHOLE_CALL: 100.0}, max_tokens=1
        )
        assert (shown.text, shown.tool_calls) == (CALL_TEXT, [])
        for bad, code in (
            ({"tools": [{"name": "no spaces allowed"}]}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"tools": TOOLS, "tool_choice": "nope"}, grpc.StatusCode.INVALID_ARGUMENT),
            ({**FORCED, "json_object": True}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"tool_choice": "required"}, grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(TandemError) as refused:
                client.generate(CHAT, **bad)
            assert refused.value.code == code, bad


def test_a_model_without_a_tool_format_refuses_tools(engine_client: EngineClient) -> None:
    with pytest.raises(TandemError) as refused:
        engine_client.generate(CHAT, tools=TOOLS, max_tokens=4)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_the_openai_sdk_forced_auto_and_streamed(
    cluster: tuple[list[ServiceProcess], GatewayProcess],
) -> None:
    _, gateway = cluster
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    base: dict[str, Any] = dict(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=160, seed=5)
    with _sdk(gateway) as sdk:
        reply = sdk.chat.completions.create(**base, tool_choice=named, parallel_tool_calls=False)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.function.name == "get_weather"
        _valid(call.function.name, call.function.arguments)
        # /tokenize renders the tools as the chat did.
        counted = urllib.request.Request(
            gateway.http + "/tokenize",
            data=json.dumps({"messages": CHAT, "tools": TOOLS}).encode(),
            method="POST",
        )
        with urllib.request.urlopen(counted, timeout=30) as answer:
            assert reply.usage and json.load(answer)["count"] == reply.usage.prompt_tokens
        # The same request streamed: OpenAI's delta shape, and the same call once joined.
        stream = sdk.chat.completions.create(
            **base, tool_choice=named, parallel_tool_calls=False, stream=True
        )
        deltas = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or []]
        first, rest = deltas[0], deltas[1:]
        assert first.id and first.type == "function" and first.function
        assert first.function.name == "get_weather" and len(rest) > 3
        assert all(
            d.index == 0 and d.id is None and d.function and not d.function.name for d in rest
        )
        joined = "".join((d.function.arguments or "") for d in deltas if d.function)
        assert joined == call.function.arguments
        # Auto, the model's own call parsed; "required" with several calls allowed.
        auto = sdk.chat.completions.create(
            **{**base, "max_tokens": 2}, logit_bias={str(WHOLE_CALL): 100}
        )
        calls = auto.choices[0].message.tool_calls or []
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}] * 2
        assert len({c.id for c in calls}) == 2
        for bad in ({"tools": [{"type": "retrieval"}]}, {"tool_choice": {"type": "function"}}):
            with pytest.raises(openai.BadRequestError):
                sdk.chat.completions.create(**{**base, **bad})


def test_the_async_sdk_n_choices_of_a_forced_call_whole_and_streamed(
    cluster: tuple[list[ServiceProcess], GatewayProcess],
) -> None:
    _, gateway = cluster

    async def run() -> tuple[Any, dict[int, str]]:
        async with openai.AsyncOpenAI(
            base_url=gateway.http + "/v1", api_key="x", max_retries=0
        ) as sdk:
            request: Any = dict(
                model=MODEL,
                messages=CHAT,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                n=3,
                seed=9,
                temperature=1.0,
                max_tokens=160,
            )
            whole = await sdk.chat.completions.create(**request)
            streamed: dict[int, str] = {}  # each choice's arguments, joined
            async for chunk in await sdk.chat.completions.create(**request, stream=True):
                for choice in chunk.choices:
                    for d in choice.delta.tool_calls or []:
                        piece = d.function.arguments if d.function else None
                        streamed[choice.index] = streamed.get(choice.index, "") + (piece or "")
            return whole, streamed

    reply, streamed = asyncio.run(run())
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    for choice in reply.choices:
        (call,) = choice.message.tool_calls or []
        _valid(call.function.name, call.function.arguments)
        assert streamed[choice.index] == call.function.arguments  # the same seeds, streamed


def test_langchain_bind_tools_round_trip(
    cluster: tuple[list[ServiceProcess], GatewayProcess],
) -> None:
    engines, gateway = cluster
    chat = ChatOpenAI(
        model=MODEL,
        base_url=gateway.http + "/v1",
        api_key=SecretStr("x"),
        max_completion_tokens=160,
        max_retries=0,
    )
    asked = [HumanMessage("What is the weather in Paris?")]
    with_tools = chat.bind_tools(
        [TOOLS[0], TOOLS[1]], tool_choice="get_weather", parallel_tool_calls=False
    )
    answer = with_tools.invoke(asked)
    (call,) = answer.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER)
    # The tool's reply goes back as a tool message; the model answers in text.
    history = [*asked, answer, ToolMessage("Sunny, 21 C", tool_call_id=call["id"])]
    final = chat.bind_tools([TOOLS[0]], tool_choice="none").invoke(history)
    assert isinstance(final.content, str) and not final.tool_calls
    # The call and its answer reached the template: the prompt is that history, rendered.
    rendered: list[dict[str, Any]] = [
        CHAT[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call["id"], "function": {"name": call["name"], "arguments": call["args"]}}
            ],
        },
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": call["id"]},
    ]
    with EngineClient(engines[1].address) as client:
        want = len(client.tokenize(messages=rendered, tools=[TOOLS[0]]))
    assert final.response_metadata["token_usage"]["prompt_tokens"] == want


def test_responses_text_stream_and_a_tool_call(
    cluster: tuple[list[ServiceProcess], GatewayProcess],
) -> None:
    """/v1/responses through the SDK's responses.create: text, its event stream, a forced
    call, and the call's output sent back as the next turn's input."""
    engines, gateway = cluster
    with (
        _sdk(gateway) as sdk,
        EngineClient(engines[1].address) as client,
    ):
        text = sdk.responses.create(
            model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=6
        )
        want = client.generate(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
            max_tokens=6,
            temperature=0,  # the default below is 1.0 with a seed; compare greedy instead
        )
        assert text.status in ("completed", "incomplete")
        assert text.usage and want.usage and text.usage.input_tokens == want.usage.prompt_tokens
        greedy = sdk.responses.create(
            model=MODEL,
            input=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Hello"},
            ],
            max_output_tokens=6,
            temperature=0,
        )
        assert greedy.output_text == want.text
        # Streamed: the SDK's typed events, the text deltas joined equal to the whole.
        events = list(
            sdk.responses.create(
                model=MODEL,
                input="Hello",
                instructions="Be brief.",
                max_output_tokens=6,
                temperature=0,
                stream=True,
            )
        )
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == want.text
        # A forced call, parsed; then its output as input to the next turn.
        called = sdk.responses.create(
            model=MODEL,
            input="What is the weather in Paris?",
            tools=FLAT_TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            max_output_tokens=160,
        )
        (call,) = [o for o in called.output if o.type == "function_call"]
        _valid(call.name, call.arguments)
        streamed = sdk.responses.create(
            model=MODEL,
            input="What is the weather in Paris?",
            tools=FLAT_TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=160,
            stream=True,
        )
        arguments = ""
        for event in streamed:
            if event.type == "response.function_call_arguments.delta":
                arguments += event.delta
            if event.type == "response.output_item.done" and event.item.type == "function_call":
                assert event.item.arguments == arguments
        _valid("get_weather" if "city" in arguments else "get_time", arguments)
        history: list[Any] = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
        ]
        answer = sdk.responses.create(model=MODEL, input=history, max_output_tokens=4)
        assert [o.type for o in answer.output] == ["message"]
        for bad in ({"conversation": "conv_1"}, {"include": ["reasoning.encrypted_content"]}):
            with pytest.raises(openai.BadRequestError) as refused:
                sdk.responses.create(model=MODEL, input="x", **bad)
            assert refused.value.param == next(iter(bad))


def test_previous_response_id_continues_a_kept_conversation(
    cluster: tuple[list[ServiceProcess], GatewayProcess],
) -> None:
    """With --store the gateway keeps each response's history: a next turn by
    previous_response_id is the same prompt as the whole history sent again, and its KV comes
    from the prefix cache; store=false keeps nothing, another namespace finds nothing."""
    _, gateway = cluster
    asked = "What is the weather in Paris?"
    with _sdk(gateway) as sdk:
        first = sdk.responses.create(
            model=MODEL,
            input=asked,
            instructions="Use the tools.",
            tools=FLAT_TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            max_output_tokens=160,
        )
        assert (first.model_extra or {})["store"] is True  # kept (not an SDK field)
        (call,) = [o for o in first.output if o.type == "function_call"]
        answer: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
        chained = sdk.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input=answer,
            instructions="Use the tools.",
            tools=FLAT_TOOLS,
            max_output_tokens=4,
            temperature=0,
        )
        whole: Any = [
            {"role": "user", "content": asked},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            *answer,
        ]
        sent_again = sdk.responses.create(
            model=MODEL,
            input=whole,
            instructions="Use the tools.",
            tools=FLAT_TOOLS,
            max_output_tokens=4,
            temperature=0,
            store=False,
        )
        assert chained.previous_response_id == first.id
        assert chained.usage and sent_again.usage
        assert chained.usage.input_tokens == sent_again.usage.input_tokens
        assert chained.output_text == sent_again.output_text
        assert chained.usage.input_tokens_details.cached_tokens > 0  # the first turn's KV
        # A turn further: the chain's history grows by each answer.
        third = sdk.responses.create(  # tools and instructions are sent each turn
            model=MODEL,
            previous_response_id=chained.id,
            input="Thanks.",
            instructions="Use the tools.",
            tools=FLAT_TOOLS,
            max_output_tokens=2,
        )
        assert third.usage and third.usage.input_tokens > chained.usage.input_tokens
        for missing, extra in (
            (sent_again.id, {}),  # store=false: not kept
            (first.id, {"tandem": {"namespace": "elsewhere"}}),  # kept in another namespace
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                sdk.responses.create(
                    model=MODEL, previous_response_id=missing, input="x", extra_body=extra
                )
            assert refused.value.code == "previous_response_not_found"


def _serving(engines: list[ServiceProcess]) -> ServiceProcess:
    """The engine running a generation now."""
    for engine in engines:
        with EngineClient(engine.address) as client:
            if client.stats().running:
                return engine
    raise AssertionError("no engine is running the stream")


def test_a_forced_call_killed_mid_arguments_resumes_exactly_on_another_engine(
    cluster: tuple[list[ServiceProcess], GatewayProcess],
) -> None:
    """The last test of the module: it kills one of its engines."""
    engines, gateway = cluster
    body: dict[str, Any] = dict(
        model=MODEL,
        messages=CHAT,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        temperature=1.0,
        seed=17,
        max_tokens=160,
    )
    with _sdk(gateway) as sdk:
        whole = sdk.chat.completions.create(**body)
        (want,) = whole.choices[0].message.tool_calls or []
        stream = sdk.chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True}
        )
        pieces: list[str] = []
        usage = None
        killed = False
        for chunk in stream:
            for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                pieces.append(d.function.arguments or "" if d.function else "")
            if not killed and len("".join(pieces)) >= 12:  # inside the note's string
                _serving(engines).kill()
                killed = True
            usage = chunk.usage or usage
    assert killed and usage is not None and (usage.model_extra or {}).get("failovers") == 1
    assert "".join(pieces) == want.function.arguments
    _valid("get_weather", "".join(pieces))
