"""A tiny model that takes tools (issue 36): the embedded model's shape and tokenizer with
`<tool_call>` and `</tool_call>` added, a chat template that renders tools and tool history
the way Qwen2.5's does (so mlx-lm reads its calls with its JSON tool parser), and one more
token whose text is a whole call, so that a test can make the model answer with a call
(logit_bias) and see it parsed."""

from __future__ import annotations

from pathlib import Path

from engine_service.model.default_model import CONFIGS, VOCAB_SIZE, build_model_dir
from tests.model_edits import add_tokens, set_chat_template

OPEN, CLOSE, WHOLE_CALL = VOCAB_SIZE, VOCAB_SIZE + 1, VOCAB_SIZE + 2
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and tools %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tool_model(out: Path) -> Path:
    """The embedded model's shape (random weights) with the tool format added."""
    build_model_dir({**CONFIGS["tandem-tiny"], "vocab_size": VOCAB_SIZE + 3}, out)
    add_tool_format(out)
    return out


def add_tool_format(out: Path) -> None:
    """The tool tokens and template added to a model directory build_model_dir wrote (its
    vocabulary must reach WHOLE_CALL: benchmark shapes' do)."""
    add_tokens(out, {OPEN: "<tool_call>", CLOSE: "</tool_call>", WHOLE_CALL: CALL_TEXT})
    set_chat_template(out, TOOLS_TEMPLATE)
