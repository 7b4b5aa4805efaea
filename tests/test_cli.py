"""Every `tandem` command against real services, in subprocesses: output, --json, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem_client import EngineClient
from tests.servers import ROOT, ServiceProcess, free_port, store_and_engine

LONG_SYSTEM = "You are a careful assistant. " * 20  # makes the prompt long enough to cache


@pytest.fixture(scope="module")
def services(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path, engine: ServiceProcess
) -> Iterator[dict[str, str]]:
    yield from store_and_engine(tmp_path_factory.mktemp("cli"), engine_data_dir)


def tandem(env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem_client.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **env, "COLUMNS": "200"},
    )


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tandem: error:"), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_generate_text_and_json(services: dict[str, str]) -> None:
    text = tandem(services, "generate", "Hello world", "--max-tokens", "8")
    assert text.returncode == 0, text.stderr
    # stdout is the text alone; the usage line goes to stderr.
    assert "[length: 8 tokens" in text.stderr and "[length" not in text.stdout
    with EngineClient(services["TANDEM_ENGINE"]) as engine:
        assert text.stdout == engine.generate("Hello world", max_tokens=8).text + "\n"
    as_json = tandem(
        services,
        "generate",
        "Hello world",
        "--max-tokens",
        "8",
        "--json",
        "--temperature",
        "0.7",
        "--seed",
        "3",
    )
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["finish_reason"] == "length" and len(doc["token_ids"]) == 8
    assert doc["usage"]["generated_tokens"] == 8 and isinstance(doc["text"], str)
    # Per-request KV codec: 8-bit KV gives this model's greedy tokens here too.
    plain = json.loads(
        tandem(services, "generate", "Hello world", "--max-tokens", "8", "--json").stdout
    )
    q8 = tandem(
        services, "generate", "Hello world", "--max-tokens", "8", "--json", "--kv-bits", "8"
    )
    assert q8.returncode == 0, q8.stderr
    assert json.loads(q8.stdout)["token_ids"] == plain["token_ids"]
    # Penalties and a bias, as the client sends them.
    biased = tandem(
        services,
        *("generate", "Hello world", "--max-tokens", "4", "--json", "--logit-bias", "7=100"),
        *("--presence-penalty", "0.5", "--frequency-penalty", "0.5"),
    )
    assert biased.returncode == 0, biased.stderr
    with EngineClient(services["TANDEM_ENGINE"]) as engine:
        want = engine.generate(
            "Hello world",
            max_tokens=4,
            logit_bias={7: 100.0},
            presence_penalty=0.5,
            frequency_penalty=0.5,
        )
    assert json.loads(biased.stdout)["token_ids"] == want.token_ids
    bad_bias = tandem(services, "generate", "hi", "--logit-bias", "seven")
    assert bad_bias.returncode == 2 and "TOKEN_ID=BIAS" in bad_bias.stderr
    no_draft = tandem(services, "generate", "hi", "--num-draft-tokens", "2")
    assert no_draft.returncode == 1 and "--draft-model" in _one_error_line(no_draft)
    # Several addresses: the first is down, the stream goes through the next.
    dead = f"127.0.0.1:{free_port()}"
    moved = tandem(
        {**services, "TANDEM_ENGINE": f"{dead},{services['TANDEM_ENGINE']}"},
        *("generate", "Hello world", "--max-tokens", "8", "--json"),
    )
    assert moved.returncode == 0, moved.stderr
    assert json.loads(moved.stdout)["token_ids"] == plain["token_ids"]


def test_generate_with_constraints(services: dict[str, str], tmp_path: Path) -> None:
    schema = tmp_path / "point.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
                "additionalProperties": False,
            }
        )
    )
    shaped = tandem(services, "generate", "Point:", "--json-schema", str(schema), "--json")
    assert shaped.returncode == 0, shaped.stderr
    assert set(json.loads(json.loads(shaped.stdout)["text"])) == {"x"}
    picked = tandem(services, "generate", "Pick:", "--choice", "left", "--choice", "right")
    assert picked.returncode == 0 and picked.stdout.strip() in ("left", "right")
    grammar = tmp_path / "yn.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    said = tandem(services, "generate", "Say:", "--grammar", str(grammar))
    assert said.returncode == 0 and said.stdout.strip() in ("yes", "no")
    bad = tandem(services, "generate", "x", "--regex", "a(b")  # INVALID_ARGUMENT: exit 2
    assert bad.returncode == 2 and "unclosed group" in bad.stderr, bad.stderr
    assert bad.stderr.startswith("tandem: error:") and "Traceback" not in bad.stderr


def test_bad_input_unreachable_and_bad_flags(services: dict[str, str]) -> None:
    bad = tandem(services, "generate", "hi", "--temperature", "-1")
    assert bad.returncode == 2
    assert "temperature" in _one_error_line(bad)
    down = tandem({**services, "TANDEM_ENGINE": "127.0.0.1:1"}, "generate", "hi")
    assert down.returncode == 4
    assert "UNAVAILABLE" in _one_error_line(down)
    store_down = tandem(services, "ckpt", "ls", "--store", "127.0.0.1:1")
    assert store_down.returncode == 4
    _one_error_line(store_down)
    flag = tandem(services, "generate", "hi", "--bogus")
    assert flag.returncode == 2 and "unrecognized arguments" in flag.stderr
    wrong_port = tandem(services, "generate", "hi", "--engine", services["TANDEM_STORE"])
    assert "is that address a store?" in _one_error_line(wrong_port)
    assert "(default: 0.0)" in tandem(services, "generate", "--help").stdout


def test_chat_streams_turns_and_reuses_the_conversation_prefix(services: dict[str, str]) -> None:
    result = tandem(
        services,
        "chat",
        "--system",
        LONG_SYSTEM,
        "--max-tokens",
        "6",
        stdin="Hello there\nAnd again\n",
    )
    assert result.returncode == 0, result.stderr
    usage = [line for line in result.stdout.splitlines() if line.startswith("[length")]
    assert len(usage) == 2 and result.stdout.count("assistant>") == 2
    cached = [int(line.split(", ")[1].split()[0]) for line in usage]
    assert cached[0] == 0 and cached[1] >= 64  # the second turn reuses the first's prefix


def _ls(services: dict[str, str], *filters: str) -> list[dict[str, Any]]:
    result = tandem(services, "ckpt", "ls", "--json", *filters)
    assert result.returncode == 0, result.stderr
    listed: list[dict[str, Any]] = json.loads(result.stdout)
    return listed


def test_ckpt_commands(services: dict[str, str], tmp_path: Path) -> None:
    prompt = " ".join(f"word{i}" for i in range(120))
    assert (
        tandem(services, "generate", prompt, "--max-tokens", "2", "--namespace", "cli").returncode
        == 0
    )
    assert tandem(services, "ckpt", "flush").returncode == 0  # the store's own barrier
    _wait_for_record(services)
    records = _ls(services, "--namespace", "cli")
    assert len(records) == 1 and records[0]["kind"] == "prefix"
    key = records[0]["key"]

    table = tandem(services, "ckpt", "ls", "--namespace", "cli")
    assert table.returncode == 0 and key[:16] in table.stdout and "prefix" in table.stdout
    # In a pipe: a header and one tab-separated line a record, nothing wrapped.
    title, header, row = table.stdout.splitlines()
    assert title.startswith("# ")
    assert header.split("\t")[:3] == ["key", "namespace", "kind"]
    assert row.split("\t")[:3] == [key[:16], "cli", "prefix"]
    # The 16 digits the table shows name the record.
    pasted = tandem(services, "ckpt", "show", key[:16], "--namespace", "cli", "--json")
    assert pasted.returncode == 0 and json.loads(pasted.stdout)["summary"]["key"] == key
    show = tandem(services, "ckpt", "show", key, "--namespace", "cli")
    assert show.returncode == 0 and "tensors" in show.stdout and "kv:plain" in show.stdout
    shown = json.loads(tandem(services, "ckpt", "show", key, "--namespace", "cli", "--json").stdout)
    assert shown["summary"]["key"] == key and len(shown["tensors"]) == 8

    export = tmp_path / "prefix.tckpt"
    result = tandem(services, "ckpt", "export", key, str(export), "--namespace", "cli")
    assert result.returncode == 0, result.stderr
    assert export.stat().st_size > records[0]["payload_bytes"]
    assert tandem(services, "ckpt", "rm", key, "--namespace", "cli").returncode == 0
    assert _ls(services, "--namespace", "cli") == []
    imported = tandem(services, "ckpt", "import", str(export), "--namespace", "copied", "--json")
    assert imported.returncode == 0, imported.stderr
    assert json.loads(imported.stdout)["key"] == key
    copy = json.loads(
        tandem(services, "ckpt", "show", key, "--namespace", "copied", "--json").stdout
    )
    assert copy["tensors"] == shown["tensors"] and copy["metadata"] == shown["metadata"]

    stats = json.loads(tandem(services, "ckpt", "stats", "--json").stdout)
    assert stats["records"] >= 1 and stats["sync_mode"] == "commit"
    assert "payload_bytes" in tandem(services, "ckpt", "stats").stdout
    dry = json.loads(
        tandem(services, "ckpt", "purge", "--namespace", "copied", "--dry-run", "--json").stdout
    )
    assert dry["records"] == 1 and dry["dry_run"]
    assert len(_ls(services, "--namespace", "copied")) == 1
    purged = json.loads(tandem(services, "ckpt", "purge", "--namespace", "copied", "--json").stdout)
    assert purged["records"] == 1 and _ls(services, "--namespace", "copied") == []
    compact = json.loads(tandem(services, "ckpt", "compact", "--json").stdout)
    assert compact["file_bytes_after"] <= compact["file_bytes_before"]
    assert json.loads(tandem(services, "ckpt", "flush", "--json").stdout) == {"durable": True}


def test_ckpt_errors(services: dict[str, str], tmp_path: Path) -> None:
    missing = tandem(services, "ckpt", "rm", "00ff00ff")
    assert missing.returncode == 3
    assert "NOT_FOUND" in _one_error_line(missing)
    bad_key = tandem(services, "ckpt", "show", "not-hex")
    assert bad_key.returncode == 2
    assert "hex" in _one_error_line(bad_key)
    junk = tmp_path / "junk.tckpt"
    junk.write_bytes(b"not a checkpoint")
    bad_file = tandem(services, "ckpt", "import", str(junk))
    assert bad_file.returncode == 2
    _one_error_line(bad_file)


def _wait_for_record(services: dict[str, str]) -> None:
    import time

    deadline = time.monotonic() + 30
    while not _ls(services, "--namespace", "cli"):
        assert time.monotonic() < deadline, "the prefix never reached the store"
        time.sleep(0.2)
