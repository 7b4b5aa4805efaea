"""Zoo architectures through real store and engine processes: gpt-oss (YaRN rope scaling,
attention sinks, sliding windows), whose quantized attention mlx-lm cannot run.

- a scaled-rope model serves (its rope frequencies evaluated at load), equal to mlx-lm;
- 8-bit KV is refused with INVALID_ARGUMENT before it joins a batch, and three 400-token
  plain streams running beside that request complete exactly;
- a generation killed (SIGKILL) right after its first token resumes exactly (gpt-oss and
  ministral3 here, every architecture under `make soak`);
- an engine whose default KV codec the model cannot run does not start.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from tandem_client import EngineClient, StoreClient
from tandem_client.errors import TandemError
from tests.model_zoo import ZOO, build_zoo_model
from tests.servers import (
    ServiceProcess,
    free_port,
    kill_after_checkpoint,
    resume_equals_uninterrupted,
    run_module,
    start_engine,
    start_store_on,
)

LONG = 160  # five times the sliding window: the streams' caches wrap


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_zoo_model("gpt_oss", tmp_path_factory.mktemp("zoo-gpt-oss"))


@pytest.fixture
def stack(
    tmp_path: Path, engine_data_dir: Path, gpt_oss: Path
) -> Iterator[tuple[ServiceProcess, int]]:
    port = free_port()
    store = start_store_on(tmp_path / "store", port)
    args = ["--model", str(gpt_oss), "--store", f"127.0.0.1:{port}"]
    engine = start_engine(engine_data_dir, *args, log_dir=tmp_path)
    try:
        yield engine, port
    finally:
        engine.stop()
        store.stop()


def _greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = load(str(model_dir))[0]
    model.set_dtype(mx.float32, lambda t: mx.issubdtype(t, mx.floating))
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def test_plain_streams_complete_beside_a_refused_quantized_request(
    stack: tuple[ServiceProcess, int], gpt_oss: Path
) -> None:
    engine, _ = stack
    prompts = [[(i * 131 + j * 17) % 2000 + 3 for j in range(40 + 9 * i)] for i in range(3)]
    with EngineClient(engine.address) as client, ThreadPoolExecutor(4) as pool:
        streams = [
            pool.submit(client.generate, p, max_tokens=LONG, ignore_eos=True) for p in prompts
        ]
        with pytest.raises(TandemError) as refused:
            client.generate(prompts[0], max_tokens=8, kv_bits=8, kv_group_size=32)
        results = [s.result(timeout=300) for s in streams]
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sinks" in str(refused.value)  # the reason the start-up probe found
    for prompt, got in zip(prompts, results, strict=True):
        assert got.token_ids == _greedy(gpt_oss, prompt, LONG)


def test_an_engine_whose_default_kv_codec_cannot_run_does_not_start(
    gpt_oss: Path, engine_data_dir: Path
) -> None:
    done = run_module(
        "engine_service",
        *("--listen", "127.0.0.1:0", "--data-dir", str(engine_data_dir)),
        *("--model", str(gpt_oss), "--kv-bits", "8", "--kv-group-size", "32"),
    )
    assert done.returncode != 0
    assert "listening" not in done.stdout
    assert "the engine's default KV codec cannot run on this model" in done.stderr
    assert "attention sinks" in done.stderr


# `make test` kills two architectures through real processes (gpt-oss: sliding windows the
# prompt wraps, so caches that cannot be trimmed); `make soak` every one (TANDEM_ZOO_KILLS=all).
KILLED = sorted(ZOO) if os.environ.get("TANDEM_ZOO_KILLS") == "all" else ["gpt_oss", "ministral3"]


@pytest.mark.parametrize("arch", KILLED)
def test_each_architecture_resumes_after_a_kill_at_its_first_tokens(
    arch: str, tmp_path: Path, engine_data_dir: Path
) -> None:
    model = build_zoo_model(arch, tmp_path / "models")
    port = free_port()
    store_proc = start_store_on(tmp_path / "store", port)
    args = ["--model", str(model), "--store", f"127.0.0.1:{port}"]
    engine = start_engine(engine_data_dir, *args, log_dir=tmp_path)
    store = StoreClient(f"127.0.0.1:{port}")
    try:
        prompt = [(j * 53) % 2000 + 3 for j in range(150)]
        # No interval comes due: only the snapshot taken right after the prefill exists.
        request = dict(max_tokens=48, ignore_eos=True, checkpoint_interval=1000, request_id=arch)
        received, saved = kill_after_checkpoint(engine, store, prompt, request, 1, 1)
        assert saved.token_count <= len(prompt) + 8  # taken within the first tokens
        fresh = start_engine(engine_data_dir, *args, log_dir=tmp_path / "fresh")
        try:
            resume_equals_uninterrupted(fresh.address, prompt, request, received)
        finally:
            fresh.stop()
    finally:
        engine.stop()
        store.close()
        store_proc.stop()
