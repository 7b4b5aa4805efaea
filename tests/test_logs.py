"""Structured logs: every line of an engine and a gateway started with `--log-format json`
parses, and each request leaves one line with its id, sizes and finish, without its text."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tandem_client import EngineClient, StoreClient
from tests.conftest import make_checkpoint
from tests.servers import GatewayProcess, start_engine, start_store

SECRET_PROMPT = "the launch code is swordfish"


def _json_lines(path: Path) -> list[dict[str, Any]]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # every line is JSON


def _request_line(path: Path, request_id: str, timeout: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in _json_lines(path) if e.get("request_id") == request_id]
        if found:
            assert len(found) == 1
            return found[0]
        assert time.monotonic() < deadline, f"no request line for {request_id}"
        time.sleep(0.05)


def test_json_logs_carry_one_line_per_request(tmp_path: Path, engine_data_dir: Path) -> None:
    engine = start_engine(engine_data_dir, "--log-format", "json", log_dir=tmp_path / "engine")
    gateway = GatewayProcess([engine.address], tmp_path / "gateway.log", "--log-format", "json")
    try:
        gateway.wait_engines(1)
        with EngineClient(gateway.grpc) as client:
            got = client.generate(SECRET_PROMPT, max_tokens=5, request_id="log-me", ignore_eos=True)
        assert len(got.token_ids) == 5
        line = _request_line(tmp_path / "engine" / "engine.log", "log-me")
        assert line["level"] == "info" and line["logger"] == "tandem.engine.requests"
        assert line["generated_tokens"] == 5 and line["finish"] == "length"
        assert line["prompt_tokens"] > 0 and line["ttft_s"] > 0
        assert "prompt_token_ids" not in line  # only with --log-prompts
        relayed = _request_line(tmp_path / "gateway.log", "log-me")
        assert relayed["finish"] == "FINISH_REASON_LENGTH" and relayed["tokens_sent"] == 5
        assert relayed["failovers"] == 0 and relayed["engines"] == engine.address
    finally:
        gateway.stop()
        engine.stop()
    for log in (tmp_path / "engine" / "engine.log", tmp_path / "gateway.log"):
        assert SECRET_PROMPT not in log.read_text()
        _json_lines(log)  # the whole file, shutdown included


def test_the_store_logs_each_mutation(tmp_path: Path) -> None:
    store = start_store(tmp_path / "store", "--log-format", "json")
    try:
        with StoreClient(store.address) as client:
            client.put(make_checkpoint(b"logged-key", {"k": 1024}, namespace="ops"))
            client.delete(b"logged-key", "ops")
    finally:
        store.stop()
    lines = _json_lines(store.log_path)
    changes = [e for e in lines if e["logger"] == "tandem.store.mutations"]
    assert [(e["action"], e["namespace"], e["key"]) for e in changes] == [
        ("put", "ops", b"logged-key".hex()[:16]),
        ("delete", "ops", b"logged-key".hex()[:16]),
    ]
    assert changes[0]["bytes"] == 1024 and changes[1]["freed_bytes"] == 1024


def test_log_prompts_adds_the_token_ids_only(tmp_path: Path, engine_data_dir: Path) -> None:
    engine = start_engine(
        engine_data_dir, "--log-format", "json", "--log-prompts", log_dir=tmp_path
    )
    try:
        with EngineClient(engine.address) as client:
            ids = client.tokenize(SECRET_PROMPT)
            client.generate(ids, max_tokens=2, request_id="with-prompt")
    finally:
        engine.stop()
    line = _request_line(tmp_path / "engine.log", "with-prompt")
    assert line["prompt_token_ids"] == ids
    assert SECRET_PROMPT not in (tmp_path / "engine.log").read_text()
