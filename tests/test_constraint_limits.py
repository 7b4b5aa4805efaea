"""Constraints never answer OK with a wrong output (issue 32): a choice past llguidance's
parser row is refused before compiling, constraints nothing can satisfy are refused when the
matcher's start shows it, a row whose matcher fails mid-generation ends flagged
constraint_incomplete, a failing grammar's message and log stay short, and a tokens_held
above what the generation emits is INVALID_ARGUMENT, not a silently shorter stream.

In-process on the tiny model (Grammars, wire.constraint_from_pb, the Scheduler, the
response builder), then the statuses through one real store and engine."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_service.errors import InvalidRequest
from engine_service.front import wire
from engine_service.front.policy import RequestPolicy
from engine_service.front.response_stream import ResponseBuilder, ResponseChunk
from engine_service.loop.limits import Limits
from engine_service.loop.scheduler import Scheduler
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.constraint import (
    MAX_CHOICES,
    MAX_ERROR_CHARS,
    Constraint,
    ConstraintKind,
)
from engine_service.protocol.events import Token
from engine_service.protocol.requests import GenerationRequest, stop_token_ids
from engine_service.protocol.sampling_options import SamplingOptions
from engine_service.sampling.constraints import Grammars
from tandem_client import EngineClient, StoreClient
from tandem_client.errors import InvalidArgument
from tandem_wire.pb import engine_pb2
from tests.generation_rows import Collector
from tests.servers import ServiceProcess, free_port, start_engine, start_store_on

SELF_REQUIRING = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
NOTHING = r"[^\s\S]"


def _options(n: int) -> tuple[str, ...]:
    return tuple(f"option{i}" for i in range(n))  # one shared prefix: every option live at once


@pytest.fixture(scope="module")
def tiny(engine_data_dir: Path) -> LoadedModel:
    return load_model("", engine_data_dir)


@pytest.fixture(scope="module")
def grammars(tiny: LoadedModel) -> Grammars:
    return Grammars.for_model(tiny)


def _policy(tiny: LoadedModel) -> RequestPolicy:
    return RequestPolicy(loaded=tiny, context=4096, default_max_tokens=64)


def test_a_choice_past_the_parser_row_is_refused_before_compiling(
    tiny: LoadedModel, grammars: Grammars
) -> None:
    policy = _policy(tiny)
    for n in (MAX_CHOICES + 1, 40_000):
        request = engine_pb2.GenerateRequest(text="Pick:")
        request.constraint.choice.options.extend(_options(n))
        with pytest.raises(InvalidRequest, match=f"{n} options; at most {MAX_CHOICES}"):
            wire.constraint_from_pb(request, policy)
    assert MAX_CHOICES == 1999  # llguidance's row of 2,000 items: the options and the rule
    # The most a choice holds is held exactly: the mask walks to a whole option.
    (matcher, text) = _walk(grammars, Constraint(ConstraintKind.CHOICE, choices=_options(1999)))
    assert matcher.is_accepting() and not matcher.is_error() and text in _options(1999), text


def _walk(grammars: Grammars, constraint: Constraint) -> tuple[Any, str]:
    """Follows the mask (the highest allowed non-EOS token) until only EOS is left."""
    row = grammars.row(constraint, [])
    matcher, tokens = row.matcher, []
    for _ in range(64):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = [int(t) for t in np.nonzero(bits)[0] if t not in grammars.eos_token_ids]
        if not allowed:
            break
        assert matcher.consume_token(allowed[-1]), matcher.get_error()
        tokens.append(allowed[-1])
    return matcher, grammars.tokenizer.decode_str(tokens)


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint(ConstraintKind.REGEX, NOTHING),
        Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SELF_REQUIRING)),
        # Written as Lark, the choice's row overflows on its first (forced) token.
        Constraint(ConstraintKind.LARK, "start: " + " | ".join(f'"o{i}"' for i in range(2500))),
    ],
    ids=["empty-regex", "self-requiring-schema", "lark-row-overflow"],
)
def test_a_constraint_nothing_satisfies_is_refused_at_compile(
    grammars: Grammars, constraint: Constraint
) -> None:
    with pytest.raises(InvalidRequest, match="cannot be matched"):
        grammars.compile(constraint)


def test_a_matcher_failing_mid_generation_ends_the_row_incomplete(tiny: LoadedModel) -> None:
    # The first token is free (x or y), so the compile's probe passes; the 2,500-option rule
    # after it overflows the parser's row, the matcher fails and allows only EOS.
    big = " | ".join(f'"o{i}"' for i in range(2500))
    constraint = Constraint(ConstraintKind.LARK, f'start: ("x" | "y") big\nbig: {big}\n')
    options = SamplingOptions(temperature=1.0, seed=3, constraint=constraint)
    request = GenerationRequest(
        request_id="overflow",
        prompt=[40, 41, 42, 43],
        max_tokens=32,
        sampling=options,
        namespace="default",
        stop_ids=stop_token_ids(options, tiny.eos_token_ids),
        layout=list(tiny.layout),
    )
    scheduler = Scheduler(tiny, Limits(max_running=2, max_queued=2))
    scheduler.start()
    try:
        sink = Collector()
        scheduler.submit(request, sink)
        finished = sink.wait()
    finally:
        scheduler.shutdown()
    assert tiny.tokenizer.decode(sink.tokens[:1]) in ("x", "y")
    assert finished.reason == "stop" and finished.constraint_incomplete, sink.tokens


def test_a_failing_grammar_is_neither_logged_nor_answered_whole(
    grammars: Grammars, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "(" + "SECRET|" * 10_000 + "a"  # 70,002 characters, an unclosed group
    caplog.set_level(logging.INFO, logger="engine_service.sampling.constraints")
    with pytest.raises(InvalidRequest) as refused:
        grammars.compile(Constraint(ConstraintKind.REGEX, secret))
    assert len(str(refused.value)) < MAX_ERROR_CHARS + 40
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "regex of 70002 characters refused" in logged
    assert logged.count("SECRET") < 60 and len(logged) < 2 * MAX_ERROR_CHARS


def test_a_generation_ending_below_tokens_held_is_refused_not_shortened(
    tiny: LoadedModel,
) -> None:
    options = SamplingOptions()
    request = GenerationRequest(
        request_id="held",
        prompt=[40, 41],
        max_tokens=20,
        sampling=options,
        namespace="default",
        stop_ids=stop_token_ids(options, tiny.eos_token_ids),
        tokens_held=12,
    )
    out = ResponseBuilder(request, tiny.tokenizer, time.monotonic())
    chunk = ResponseChunk()
    for token in [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]:
        out.add(chunk, Token(token))
    assert out.finish(ResponseChunk(), "length").usage is not None  # 12 held of 12: fine
    short = ResponseBuilder(request, tiny.tokenizer, time.monotonic())
    for token in [50, 51, 52]:
        short.add(chunk, Token(token))
    with pytest.raises(InvalidRequest, match="tokens_held 12 exceeds the 3 tokens"):
        short.finish(ResponseChunk(), "stop")


# Through a real store and engine: the statuses a client sees.

PROMPT = [(i * 977) % 2000 + 3 for i in range(40)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path) -> Iterator[str]:
    root = tmp_path_factory.mktemp("limits")
    port = free_port()
    store = start_store_on(root / "store", port)
    engine: ServiceProcess | None = None
    try:
        engine = start_engine(engine_data_dir, "--store", f"127.0.0.1:{port}", log_dir=root)
        yield f"{engine.address} 127.0.0.1:{port}"
    finally:
        if engine is not None:
            engine.stop()
        store.stop()


def test_refused_constraints_are_invalid_argument_over_grpc(stack: str) -> None:
    address = stack.split()[0]
    with EngineClient(address) as client:
        for options in (_options(2000), _options(40_000)):
            with pytest.raises(InvalidArgument, match="at most 1999"):
                client.generate("Pick:", choice=options, max_tokens=8)
        with pytest.raises(InvalidArgument, match="cannot be matched"):
            client.generate("Nothing:", regex=NOTHING, max_tokens=8)
        with pytest.raises(InvalidArgument, match="cannot be matched"):
            client.generate("Self:", json_schema=SELF_REQUIRING, max_tokens=8)
        fine = client.generate("Pick:", choice=["red", "green"], max_tokens=8)
        assert fine.text in ("red", "green") and fine.finish_reason == "stop"


def test_a_resume_holding_more_than_the_generation_emits_is_invalid_argument(
    stack: str,
) -> None:
    address, store_address = stack.split()
    with EngineClient(address) as client:
        sampling = dict(max_tokens=40, ignore_eos=True, temperature=1.0, seed=7)
        reference = client.generate(PROMPT, namespace="ref", **sampling)
        # A stop token the run first meets past 12 tokens: the generation emits at + 1.
        at = next(i for i, t in enumerate(reference.token_ids) if i >= 12 and t not in
                  reference.token_ids[:i])  # fmt: skip
        request = dict(
            stop_token_ids=[reference.token_ids[at]], checkpoint_interval=4, request_id="held",
            **sampling,
        )  # fmt: skip
        stream = client.stream_request(client.request(PROMPT, **request))
        received: list[int] = []
        for chunk in stream:
            received.extend(chunk.token_ids)
            if len(received) >= 8:
                break
        stream.close()  # a disconnect keeps the checkpoint for a resume
        deadline = time.monotonic() + 30
        # The dropped row gone (else ALREADY_EXISTS), and what it left in the store: its
        # checkpoint, or its tombstone had it finished before the disconnect reached the
        # engine (the flush waits for what the spill queue holds).
        while client.stats().running:
            assert time.monotonic() < deadline, "the dropped row is still running"
            time.sleep(0.05)
        client.flush()
        with StoreClient(store_address) as store:
            assert store.list_all(kind="generation") or any(
                r.payload_bytes == 0 for r in store.list_all(kind="object")
            )
        # Whether the generation ended before this resume or ends during it (the disconnect
        # races the engine's last tokens), the claim is refused alike.
        with pytest.raises(InvalidArgument, match=f"tokens_held 30 exceeds the {at + 1} tokens"):
            client.generate(PROMPT, resume=True, tokens_held=30, **request)
        # The same claim without a checkpoint (a failover that starts again) is refused too.
        with pytest.raises(InvalidArgument, match="tokens_held 30 exceeds"):
            client.generate(PROMPT, tokens_held=30, **{**request, "request_id": "fresh"})
