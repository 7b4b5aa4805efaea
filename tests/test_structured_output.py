"""Structured output (engine_service/sampling/constraints.py) against a real engine: JSON Schema,
regex, choice and grammar constraints hold on the tiny model (random weights: the constraint does
all the work), constrained rows in a batch equal their solo runs, a SIGKILL mid-generation resumes
exactly, and bad constraints are INVALID_ARGUMENT."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tandem_client import EngineClient, StoreClient
from tandem_client.errors import InvalidArgument, NotFound
from tests.servers import (
    ServiceProcess,
    free_port,
    generation_progress,
    start_engine,
    start_store_on,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_schema_output_parses_and_validates(engine: ServiceProcess) -> None:
    with EngineClient(engine.address) as client:
        for seed in range(20):
            g = client.generate(
                "Describe a person:", json_schema=PERSON, max_tokens=120, temperature=1.0,
                seed=seed,
            )  # fmt: skip
            assert g.finish_reason == "stop", (seed, g.text)
            assert g.usage is not None and not g.usage.constraint_incomplete
            jsonschema.validate(json.loads(g.text), PERSON)


def test_regex_choice_and_grammar_constraints_hold(engine: ServiceProcess) -> None:
    with EngineClient(engine.address) as client:
        for seed in range(5):
            g = client.generate("Date:", regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", seed=seed,
                                temperature=1.0, max_tokens=40)  # fmt: skip
            assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", g.text), g.text
            pick = client.generate("Pick:", choice=["red", "green", "blue"], seed=seed,
                                   temperature=1.0, max_tokens=20)  # fmt: skip
            assert pick.text in ("red", "green", "blue") and pick.finish_reason == "stop"
        lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/\n'
        g = client.generate("Sum:", lark=lark, max_tokens=40, temperature=1.0, seed=3)
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", g.text), g.text
        gbnf = 'root ::= "yes" | "no"\n'
        g = client.generate("Answer:", gbnf=gbnf, max_tokens=10)
        assert g.text in ("yes", "no")
        obj = client.generate("Object:", json_object=True, max_tokens=60, seed=1, temperature=1.0)
        if obj.finish_reason == "stop":
            assert isinstance(json.loads(obj.text), dict)
        else:  # cut short: said so
            assert obj.usage is not None and obj.usage.constraint_incomplete


def test_a_constrained_row_cut_by_max_tokens_says_it_is_incomplete(
    engine: ServiceProcess,
) -> None:
    with EngineClient(engine.address) as client:
        g = client.generate("Person:", json_schema=PERSON, max_tokens=3)
        assert g.finish_reason == "length" and len(g.token_ids) == 3
        assert g.usage is not None and g.usage.constraint_incomplete
        plain = client.generate("Person:", max_tokens=3, ignore_eos=True)
        assert plain.usage is not None and not plain.usage.constraint_incomplete


MIXED: list[dict[str, Any]] = [
    {"json_schema": PERSON},
    {},
    {"regex": r"[a-z]{3,8}( [a-z]{3,8}){2}"},
    {"choice": ["alpha", "beta", "gamma", "delta"]},
    {"json_schema": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
    {"ignore_eos": True},
    {"json_object": True},
    {"regex": r"[0-9]+(\.[0-9]+)?"},
]


def test_mixed_rows_in_one_batch_equal_their_solo_runs(engine: ServiceProcess) -> None:
    def run(i: int) -> list[int]:
        with EngineClient(engine.address) as client:
            options = {"temperature": 0.9, "seed": 40 + i, "max_tokens": 48, **MIXED[i]}
            return client.generate(f"Row {i}:", **options).token_ids

    solo = [run(i) for i in range(len(MIXED))]
    with ThreadPoolExecutor(len(MIXED)) as pool:
        together = list(pool.map(run, range(len(MIXED))))
    assert together == solo


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": {"type": "nonsense"}}, "nonsense"),
        ({"regex": "a(b"}, "regex"),
        ({"lark": "start: undefined_rule"}, "lark"),
        ({"gbnf": "root ::= ("}, "gbnf"),
        ({"choice": []}, "choice"),
        ({"choice": ["ok", ""]}, "choice"),
    ],
)
def test_bad_constraints_are_invalid_argument(
    engine: ServiceProcess, options: dict[str, Any], needle: str
) -> None:
    with EngineClient(engine.address) as client:
        if options.get("choice") == []:  # an empty oneof member: sent by hand
            request = client.request("x", max_tokens=4)
            request.constraint.choice.SetInParent()
            with pytest.raises(InvalidArgument) as raised:
                list(client.stream_request(request))
        else:
            with pytest.raises(InvalidArgument) as raised:
                client.generate("x", max_tokens=4, **options)
    assert needle in str(raised.value)


LIST = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 20,
    "maxItems": 24,
}


def test_a_constrained_generation_resumes_exactly_after_sigkill(
    tmp_path: Path, engine_data_dir: Path
) -> None:
    """The matcher is rebuilt by replaying the generated tokens: the resumed output equals the
    uninterrupted one, and it is still valid. A resume under another constraint finds nothing
    (the constraint is part of the generation's identity)."""
    port = free_port()
    store = start_store_on(tmp_path / "store", port)
    engine = start_engine(engine_data_dir, "--store", f"127.0.0.1:{port}", log_dir=tmp_path)
    try:
        request = dict(max_tokens=80, checkpoint_interval=8, request_id="shaped", json_schema=LIST,
                       temperature=0.8, seed=11)  # fmt: skip
        received: list[int] = []
        with EngineClient(engine.address) as client:
            for chunk in client.stream_request(client.request("Numbers:", **request)):
                received.extend(chunk.token_ids)
                if len(received) >= 30:
                    break
        with StoreClient(f"127.0.0.1:{port}") as admin:
            deadline = time.monotonic() + 30
            while not any(n >= 20 for n in generation_progress(admin).values()):
                assert time.monotonic() < deadline, "no checkpoint past 20 tokens"
                time.sleep(0.05)
        engine.kill()
        engine = start_engine(engine_data_dir, "--store", f"127.0.0.1:{port}", log_dir=tmp_path)
        with EngineClient(engine.address) as client:
            with pytest.raises(NotFound):
                client.generate("Numbers:", resume=True, **{**request, "json_schema": PERSON})
            resumed = client.generate("Numbers:", resume=True, tokens_held=len(received), **request)
            full = client.generate("Numbers:", **{**request, "request_id": "reference"})
        assert received + resumed.token_ids == full.token_ids
        assert full.finish_reason == "stop"
        jsonschema.validate(json.loads(full.text), LIST)
    finally:
        engine.stop()
        store.stop()
