"""A reasoning model's chat answers split into reasoning and content (issue 36): the splitter
in-process, and a tiny model whose tokenizer has `<think>`/`</think>` and whose chat template
opens the reasoning, through a real engine and gateway."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engine_service.front.reasoning import ReasoningSplit
from engine_service.model.default_model import CHAT_TEMPLATE, VOCAB_SIZE, build_model_dir
from tandem_client import EngineClient
from tests.model_edits import add_tokens, set_chat_template
from tests.servers import GatewayProcess, ServiceProcess, start_engine

THINK, UNTHINK = VOCAB_SIZE, VOCAB_SIZE + 1  # the two token ids the thinking model adds
CHAT = [{"role": "user", "content": "Why is the sky blue?"}]


def _fed(split: ReasoningSplit, pieces: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for piece in pieces:
        part = split.add(piece)
        reasoning, content = reasoning + part.reasoning, content + part.content
    part = split.finish()
    return reasoning + part.reasoning, content + part.content


def test_the_split_follows_the_markers_across_pieces() -> None:
    pieces = ["Let me th", "ink.</th", "ink>\n\nThe answer", " is <", "b>42</b>."]
    assert _fed(ReasoningSplit("<think>", "</think>", True), pieces) == (
        "Let me think.",
        "\n\nThe answer is <b>42</b>.",
    )
    # Outside first, then a reasoning block, then outside again; markers in neither.
    pieces = ["Hi <think>hmm", "</think> there <thi", "nk>more"]
    assert _fed(ReasoningSplit("<think>", "</think>", False), pieces) == ("hmmmore", "Hi  there ")
    # A held tail that never becomes a marker is released at the end, where it belongs.
    assert _fed(ReasoningSplit("<think>", "</think>", True), ["a </thi"]) == ("a </thi", "")


def _thinking_model(root: Path) -> Path:
    """The embedded model's shape with two more tokens, `<think>` and `</think>`, and a chat
    template that opens the reasoning (as Qwen3's does with thinking on)."""
    out = root / "tandem-tiny-think"
    build_model_dir({**_tiny_config(), "vocab_size": VOCAB_SIZE + 2}, out)
    add_tokens(out, {THINK: "<think>", UNTHINK: "</think>"})
    template = CHAT_TEMPLATE.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"
    )
    assert template != CHAT_TEMPLATE
    set_chat_template(out, template)
    return out


def _tiny_config() -> dict[str, Any]:
    from engine_service.model.default_model import CONFIGS

    return dict(CONFIGS["tandem-tiny"])


@pytest.fixture(scope="module")
def thinking(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path
) -> Iterator[tuple[ServiceProcess, GatewayProcess]]:
    root = tmp_path_factory.mktemp("reasoning")
    model = _thinking_model(root)
    engine = start_engine(engine_data_dir, "--model", str(model), log_dir=root)
    gateway = GatewayProcess([engine.address], root / "gateway.log")
    try:
        gateway.wait_engines(1)
        yield engine, gateway
    finally:
        gateway.stop()
        engine.stop()


def test_a_chat_answer_is_split_where_the_model_closes_its_reasoning(
    thinking: tuple[ServiceProcess, GatewayProcess],
) -> None:
    engine, _ = thinking
    with EngineClient(engine.address) as client:
        ids = client.tokenize(messages=CHAT)
        assert THINK in ids and UNTHINK not in ids  # the template opened the reasoning
        for bias, want in (
            ({7: 100.0}, "reasoning"),  # never closed: all of it is reasoning
            ({UNTHINK: 100.0}, "closed"),  # closed at once, then `</think>` as plain text
        ):
            options: dict[str, Any] = dict(max_tokens=6, ignore_eos=True, logit_bias=bias)
            raw = client.generate(ids, **options)  # token ids: not a chat, not split
            chat = client.generate(CHAT, **options)
            assert chat.token_ids == raw.token_ids
            if want == "reasoning":
                assert (chat.reasoning_text, chat.text) == (raw.text, "")
            else:
                assert raw.text == "</think>" * 6
                assert (chat.reasoning_text, chat.text) == ("", "</think>" * 5)


def test_the_gateway_sends_reasoning_content(
    thinking: tuple[ServiceProcess, GatewayProcess],
) -> None:
    engine, gateway = thinking
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": CHAT[0]["content"]}]
    extra = {"tandem": {"ignore_eos": True}, "logit_bias": {"7": 100}}
    with (
        openai.OpenAI(base_url=gateway.http + "/v1", api_key="x", max_retries=0) as sdk,
        EngineClient(engine.address) as client,
    ):
        want = client.generate(CHAT, max_tokens=6, ignore_eos=True, logit_bias={7: 100.0})
        reply = sdk.chat.completions.create(
            model="tandem-tiny-think", messages=messages, max_tokens=6, extra_body=extra
        )
        message = reply.choices[0].message
        assert message.content == ""
        assert (message.model_extra or {}).get("reasoning_content") == want.reasoning_text
        stream = sdk.chat.completions.create(
            model="tandem-tiny-think",
            messages=messages,
            max_tokens=6,
            stream=True,
            extra_body=extra,
        )
        pieces = [
            (c.choices[0].delta.model_extra or {}).get("reasoning_content", "")
            for c in stream
            if c.choices
        ]
        assert "".join(pieces) == want.reasoning_text
