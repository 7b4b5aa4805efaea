"""Edits to a model directory build_model_dir wrote, for tests that need a tokenizer or chat
template of another kind (a thinking model, a tool-calling model)."""

from __future__ import annotations

import json
from pathlib import Path


def add_tokens(out: Path, tokens: dict[int, str]) -> None:
    """Added (not special) tokens, as Qwen's `<think>` and `<tool_call>` are."""
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    for token_id, content in tokens.items():
        tokenizer["added_tokens"].append(
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
        )
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))


def set_chat_template(out: Path, template: str) -> None:
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
