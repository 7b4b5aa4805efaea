"""Deterministic mode (--deterministic, model/deterministic.py): a row's logits do not depend
on its batch, so seeded rows run alone or eight together give the same tokens, and a
generation killed in a batch resumes alone exactly where it stopped.

In-process on the tiny model and a Qwen3-shaped zoo model: rows alone against the same rows
in a batch of 8 through mlx-lm's BatchGenerator, bit-identical log-probabilities each step.
The start-up refusals: rings and recurrent layers, a forward whose rows see each other, a
draft model or KV codec with the flag. Through real processes: eight seeded streams batched,
killed, and resumed on a fresh deterministic engine equal each stream's solo run, and a
default-mode engine refuses those checkpoints with FAILED_PRECONDITION; a prefix hit equals a
cold prefill bit for bit; a gateway fails a deterministic stream over to a deterministic
engine.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import grpc
import mlx.core as mx
import pytest
from mlx.nn.layers.containers import Sequential
from mlx.nn.layers.linear import Linear
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from engine_service.config import parse_args
from engine_service.kv import row_attention
from engine_service.kv.batch_cache import adopt_row
from engine_service.loop.compiled_decode import CompiledDecode
from engine_service.model.determinism_probe import NotRowInvariant, check_row_invariant
from engine_service.model.deterministic import (
    CPU_BLOCK_ROWS,
    CPU_ROWS,
    DeterministicModel,
    cpu_rows,
)
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.kv_codec import KVCodec
from gateway_service.backends import Backend, BackendPool, EngineFacts
from gateway_service.openai_wire import completion_request
from gateway_service.relay import GatewayError, Relay, RelaySettings, _Attempt
from tandem_client import EngineClient, TandemError
from tandem_client.store_client import StoreClient
from tests.batched_resume import (
    all_checkpointed,
    logprobs_of,
    resume_together,
    run_alone,
    stream_together,
    tokens_of,
)
from tests.model_zoo import build_zoo_model
from tests.servers import (
    GatewayProcess,
    InProcessStore,
    free_port,
    start_engine,
    start_store_on,
    wait_until,
)

STEPS = 12


def _logprobs(model: Any, prompts: list[list[int]]) -> list[list[mx.array]]:
    """Each row's log-probabilities per generated token, the rows in one BatchGenerator."""
    bg = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=1)
    caches = [[adopt_row(c, KVCodec()) for c in make_prompt_cache(model)] for _ in prompts]
    uids = bg.insert(prompts, max_tokens=[STEPS] * len(prompts), caches=caches)
    out: dict[int, list[mx.array]] = {uid: [] for uid in uids}
    while any(len(v) < STEPS for v in out.values()):
        for r in bg.next()[1]:
            out[r.uid].append(r.logprobs)
    bg.close()
    return [out[uid] for uid in uids]


def _rows_alone_equal_rows_batched(loaded: LoadedModel, rows_alone: bool | None = None) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, loaded.vocab_size) for _ in range(5 + 7 * i)] for i in range(8)]
    model = DeterministicModel(loaded.model, rows_alone=rows_alone)
    together = _logprobs(model, prompts)
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = _logprobs(model, [prompt])
        assert len(alone) == len(batched) == STEPS
        for step, (a, b) in enumerate(zip(alone, batched, strict=True)):
            assert mx.array_equal(a, b).item(), f"step {step} of a {len(prompt)}-token row"


# Decode attention a row at a time (the CPU's default) and in chunks from each row's start
# (what a compiled step runs, and the algorithm of the GPU's kernel).
@pytest.mark.parametrize("rows_alone", [True, False], ids=["rows alone", "chunks"])
def test_rows_alone_and_in_a_batch_of_eight_have_bit_identical_logits(
    engine_data_dir: Path, rows_alone: bool
) -> None:
    _rows_alone_equal_rows_batched(load_model("tandem-tiny", engine_data_dir), rows_alone)


def test_row_attention_over_long_rows_is_batch_invariant_and_close_to_sdpa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decode attention off MLX-CUDA (kv/row_attention.py) on rows longer than one group of
    chunks: each row alone equals the same row in a left-padded batch bit for bit, scoring
    the chunks a group at a time gives the bits of scoring them at once, and the result is
    MLX's attention to bf16 tolerance."""
    lengths = [5, 3000, 17, 2600, 700, 1]
    width, dim = max(lengths), 32
    pads = [width - n for n in lengths]
    keys = mx.random.normal((6, 2, width, dim), key=mx.random.key(1)).astype(mx.bfloat16)
    values = mx.random.normal((6, 2, width, dim), key=mx.random.key(2)).astype(mx.bfloat16)
    queries = mx.random.normal((6, 4, 1, dim), key=mx.random.key(3)).astype(mx.bfloat16)
    scale = dim**-0.5
    batched = row_attention.chunked_row_attention(queries, keys, values, scale, pads)
    monkeypatch.setattr(row_attention, "GROUP", 64)
    at_once = row_attention.chunked_row_attention(queries, keys, values, scale, pads)
    assert mx.array_equal(batched, at_once).item()
    for row, pad in enumerate(pads):
        q, k, v = (
            queries[row : row + 1],
            keys[row : row + 1, :, pad:],
            values[row : row + 1, :, pad:],
        )
        alone = row_attention.chunked_row_attention(q, k, v, scale, [0])
        assert mx.array_equal(alone, batched[row : row + 1]).item(), f"row of {lengths[row]}"
        reference = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
        assert mx.allclose(alone, reference, atol=2e-2).item()


def test_the_mode_computes_what_the_default_mode_computes(engine_data_dir: Path) -> None:
    """A row prefilled in two chunks (the second over the cache: causal attention aligned to
    the keys' end) and decoded gives the default mode's logits, to float tolerance."""
    tiny = load_model("tandem-tiny", engine_data_dir)
    prompt = [(j * 37) % 2000 + 3 for j in range(100)]

    def run(model: Any) -> list[mx.array]:
        caches = make_prompt_cache(tiny.model)
        model(mx.array([prompt[:60]]), cache=caches)
        chunk = model(mx.array([prompt[60:]]), cache=caches)
        step = model(mx.array([[5]]), cache=caches)
        mx.eval(chunk, step)
        return [chunk, step]

    for default, deterministic in zip(
        run(tiny.model), run(DeterministicModel(tiny.model)), strict=True
    ):
        assert mx.allclose(default, deterministic, atol=1e-4).item()


def test_a_qwen3_shaped_model_is_batch_invariant_too(tmp_path: Path) -> None:
    loaded = load_model(str(build_zoo_model("qwen3", tmp_path)), tmp_path)
    _rows_alone_equal_rows_batched(loaded)


@pytest.mark.parametrize("arch", ["gemma3_text", "mamba2"])
def test_models_without_plain_kv_caches_are_refused(arch: str, tmp_path: Path) -> None:
    loaded = load_model(str(build_zoo_model(arch, tmp_path)), tmp_path)
    with pytest.raises(NotRowInvariant, match="plain KV cache in every layer"):
        check_row_invariant(loaded.model)


class _RowMixing:
    """A model whose rows see each other (the batch's mean logits added to each): what the
    start-up probe exists to catch."""

    def __init__(self, model: Any) -> None:
        self.model, self.layers = model, model.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        logits: mx.array = self.model(inputs, cache=cache)
        return logits + mx.mean(logits, axis=0, keepdims=True)


def test_a_model_whose_rows_see_each_other_fails_the_start_up_probe(
    engine_data_dir: Path,
) -> None:
    tiny = load_model("tandem-tiny", engine_data_dir)
    # The real one passes: as the CPU runs it (rows attending alone, eager steps), and with the
    # chunked attention a compiled step runs (as on GPUs), compiled too.
    assert not check_row_invariant(tiny.model, 0, CompiledDecode)  # eager: nothing compiled
    assert check_row_invariant(tiny.model, 0, CompiledDecode, rows_alone=False)
    with pytest.raises(NotRowInvariant, match="not batch-invariant"):
        check_row_invariant(_RowMixing(tiny.model))
    with pytest.raises(NotRowInvariant, match="not batch-invariant"):
        check_row_invariant(_RowMixing(tiny.model), rows_alone=False)


class _Peeking(Linear):
    """A projection whose rows see the block they are in (its first row added to each): what
    a BLAS whose kernels treat a row by its place in the block would look like."""

    def __call__(self, x: mx.array) -> mx.array:
        y: mx.array = super().__call__(x)
        return y + 1e-3 * y[:1]


def test_cpu_row_blocks_only_where_every_projection_keeps_a_rows_bits(
    engine_data_dir: Path,
) -> None:
    """On the CPU the projections run in blocks of CPU_BLOCK_ROWS rows when each of the model's
    projections gives a row the same bits at every place of such a block, else a row a call;
    either way the rows above are alone and batched bit-identical."""
    tiny = load_model("tandem-tiny", engine_data_dir)
    chosen = cpu_rows(tiny.model)
    assert DeterministicModel(tiny.model).rows == chosen
    assert chosen in (CPU_BLOCK_ROWS, CPU_ROWS)
    peeking = Sequential(Linear(64, 64), _Peeking(64, 32))
    assert cpu_rows(peeking) == CPU_ROWS
    plain = Sequential(Linear(64, 64), Linear(64, 32))
    assert cpu_rows(plain) == chosen  # what the tiny model's Linears got


def test_compiled_decode_steps_give_the_eager_steps_bits(engine_data_dir: Path) -> None:
    """A row's steps run compiled or eager with what else is in its batch (its size, the
    planes' growth): rows alone through the compiled step equal the same rows in a batch of 8
    stepped eagerly. A compiled step that differs is caught by the start-up probe and left
    off."""
    tiny = load_model("tandem-tiny", engine_data_dir)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, tiny.vocab_size) for _ in range(5 + 37 * i)] for i in range(8)]
    eager = DeterministicModel(tiny.model, rows_alone=False)  # the chunks: they compile
    compiled = CompiledDecode(eager, max_batch=4)  # past 4 rows the batch steps eagerly
    together = _logprobs(compiled, prompts)
    batched_compiled = compiled.compiled_steps  # while the first rows joined
    assert batched_compiled < STEPS
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = _logprobs(compiled, [prompt])
        for step, (a, b) in enumerate(zip(alone, batched, strict=True)):
            assert mx.array_equal(a, b).item(), f"step {step} of a {len(prompt)}-token row"
    assert compiled.compiled_steps - batched_compiled >= len(prompts) * (STEPS - 2)

    def perturbed(model: Any) -> CompiledDecode:
        return CompiledDecode(_Nudged(model))

    assert not check_row_invariant(tiny.model, 0, perturbed, rows_alone=False)


class _Nudged:
    """A step whose logits are one ulp-scale nudge off the model's: a compiled step that does
    not give the eager step's bits."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        logits: mx.array = self.model(inputs, cache=cache)
        return logits * 1.0001


def test_deterministic_mode_refuses_a_draft_model_and_kv_codecs() -> None:
    for flags in (["--draft-model", "tandem-tiny"], ["--kv-bits", "8"]):
        with pytest.raises(SystemExit):
            parse_args(["--deterministic", *flags])
    config = parse_args(["--deterministic"])
    assert config.prefill_batch_size == 1 and config.compiled_decode  # probed at start-up
    assert config.deterministic_matmul == "auto"  # the kernel where it runs
    kernel = parse_args(["--deterministic", "--deterministic-matmul", "kernel"])
    assert kernel.deterministic_matmul == "kernel"
    with pytest.raises(SystemExit):
        parse_args(["--deterministic", "--deterministic-matmul", "gemv"])
    assert config.deterministic_rows_alone is None  # the device's default
    for choice, alone in (("alone", True), ("chunks", False)):
        chosen = parse_args(["--deterministic", "--deterministic-attention", choice])
        assert chosen.deterministic_rows_alone is alone


def test_eight_batched_seeded_streams_killed_resume_alone_exactly(
    tmp_path: Path, engine_data_dir: Path
) -> None:
    port = free_port()
    store_proc = start_store_on(tmp_path / "store", port)
    store = StoreClient(f"127.0.0.1:{port}")
    args = ["--store", f"127.0.0.1:{port}", "--deterministic"]
    engine = start_engine(engine_data_dir, *args, log_dir=tmp_path)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 2000) for _ in range(9 + 29 * i)] for i in range(8)]
    requests = [
        dict(
            max_tokens=96,  # long enough to find all eight checkpointed before any ends
            ignore_eos=True,
            temperature=0.9,
            seed=100 + i,
            checkpoint_interval=8,
            logprobs=0,  # each token's own log-probability: the logits' bits, observable
            request_id=f"row-{i}",
        )
        for i in range(8)
    ]
    try:
        received, threads = stream_together(engine.address, prompts, requests)
        wait_until(
            lambda: all_checkpointed(store, prompts, 8), what="eight generation checkpoints"
        )  # prompts 29 tokens apart, rows in step
        engine.kill()
        for t in threads:
            t.join(30)
        held = [tokens_of(r) for r in received]
        held_logprobs = [logprobs_of(r) for r in received]
        # A default-mode engine refuses them: they resume in the mode they started in; so
        # does a deterministic one of other arithmetic, whose bits would differ.
        started = "started with --deterministic (matmul blocks, rows default, attention alone)"
        for name, other in (
            ("default", []),
            ("chunks", [*args, "--deterministic-attention", "chunks"]),
        ):
            refusing = start_engine(
                engine_data_dir, "--store", f"127.0.0.1:{port}", *other, log_dir=tmp_path / name
            )
            try:
                with EngineClient(refusing.address) as client, pytest.raises(TandemError) as err:
                    client.generate(
                        prompts[0], resume=True, tokens_held=len(held[0]), **requests[0]
                    )
                assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, name
                assert started in str(err.value), name
            finally:
                refusing.stop()
        fresh = start_engine(engine_data_dir, *args, log_dir=tmp_path / "fresh")
        try:
            resumed = resume_together(fresh.address, prompts, requests, held, timeout=120)
            # Each alone: the reference.
            for i, alone in enumerate(run_alone(fresh.address, prompts, requests)):
                again = resumed[i]
                assert again is not None, f"stream {i} did not resume"
                assert held[i] + again.token_ids == alone.token_ids, f"stream {i}"
                # Bit for bit: the batch's and the resume's log-probabilities are the solo
                # run's (float32 on the wire, as computed).
                got = held_logprobs[i] + logprobs_of(again.chunks)
                assert got == logprobs_of(alone.chunks), f"stream {i}"
        finally:
            fresh.stop()
    finally:
        engine.stop()
        store.close()
        store_proc.stop()


def test_a_prefix_hit_gives_the_bits_of_a_cold_prefill(tmp_path: Path) -> None:
    """Deterministic mode restores a prefix only up to a prefill-chunk boundary its own prefill
    computed in whole chunks: a hit's continuation equals a cold run, log-probabilities bit for
    bit (a hit at any other length would hold another chunking's bits)."""
    engine = start_engine(
        tmp_path, "--deterministic", "--prefill-step-size", "96", log_dir=tmp_path / "logs"
    )
    rng = random.Random(5)
    first = [rng.randrange(3, 2000) for _ in range(300)]
    turn = first + [rng.randrange(3, 2000) for _ in range(90)]
    request: dict[str, Any] = dict(max_tokens=12, ignore_eos=True, logprobs=0)
    try:
        with EngineClient(engine.address) as client:
            client.generate(first, namespace="warm", **request)  # its prefix is kept
            hit = client.generate(turn, namespace="warm", **request)
            cold = client.generate(turn, namespace="cold", **request)
    finally:
        engine.stop()
    assert hit.usage is not None and cold.usage is not None
    # The first prompt's blocks match 256 positions (64-token blocks), but its 299 prefilled
    # positions were computed in chunks of 96: 192 are in whole chunks a cold run shares.
    assert hit.usage.cached_prompt_tokens == 192
    assert cold.usage.cached_prompt_tokens == 0
    assert hit.token_ids == cold.token_ids
    assert logprobs_of(hit.chunks) == logprobs_of(cold.chunks)


def test_the_gateway_fails_a_deterministic_stream_over_to_a_deterministic_engine(
    tmp_path: Path, engine_data_dir: Path
) -> None:
    """ModelInfo says --deterministic; a stream lost with its deterministic engine resumes on
    one started so, not on a default engine beside it (whose resume would be refused)."""
    store = InProcessStore(tmp_path / "store")
    flags = ["--store", store.address]
    first = start_engine(engine_data_dir, *flags, "--deterministic", log_dir=tmp_path / "d1")
    default = start_engine(engine_data_dir, *flags, log_dir=tmp_path / "n")
    second = start_engine(engine_data_dir, *flags, "--deterministic", log_dir=tmp_path / "d2")
    engines_file = tmp_path / "engines"
    engines_file.write_text(first.address + "\n")  # the stream starts on the first
    gateway = GatewayProcess(
        [],
        tmp_path / "gateway.log",
        *("--engines-file", str(engines_file), "--checkpoint-interval", "4"),
        *("--poll-interval", "0.1", "--failover-wait", "60"),
    )
    # Long enough that the first engine cannot have sent them all before it is killed.
    request: dict[str, Any] = dict(max_tokens=160, ignore_eos=True, temperature=0.9, seed=3)
    prompt = [(7 * j) % 2000 + 3 for j in range(40)]
    try:
        with EngineClient(default.address) as client:
            assert not client.model_info().deterministic
        with EngineClient(first.address) as client:
            assert client.model_info().deterministic
        gateway.wait_engines(1)
        tokens: list[int] = []
        failovers, killed = -1, False
        with EngineClient(gateway.grpc) as client:
            for chunk in client.stream(prompt, **request):
                tokens += chunk.token_ids
                if len(tokens) >= 12 and not killed:
                    # Killed at once (waiting for the gateway to see the others first let a
                    # fast engine finish the stream meanwhile); the gateway waits for them.
                    first.kill()
                    killed = True
                    everyone = [first.address, default.address, second.address]
                    engines_file.write_text("\n".join(everyone) + "\n")
                if chunk.usage is not None:
                    failovers = chunk.usage.failovers
        assert failovers == 1
        with EngineClient(default.address) as client:
            assert client.stats().requests_total == 0  # never asked to resume it
        with EngineClient(second.address) as client:
            alone = client.generate(prompt, **request).token_ids
        assert tokens == alone  # resumed exactly where it stopped
        # A request that asks for the mode: refused by a default engine, routed by the
        # gateway to the deterministic one only (the default one beside it is up).
        with EngineClient(default.address) as client:
            with pytest.raises(TandemError) as refused:
                client.generate(prompt, max_tokens=4, deterministic=True)
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "--deterministic" in str(refused.value)
            asked_before = client.stats().requests_total
        with EngineClient(gateway.grpc) as client:
            for i in range(6):  # other prompts: other places in the affinity ranking
                other = [(11 * j + i) % 2000 + 3 for j in range(20 + i)]
                done = client.generate(other, max_tokens=4, deterministic=True)
                assert len(done.token_ids) == 4
        with EngineClient(default.address) as client:
            assert client.stats().requests_total == asked_before
    finally:
        gateway.stop()
        for engine in (first, default, second):
            engine.stop()
        store.stop()


def test_a_deterministic_request_goes_to_engines_in_the_mode_or_is_refused() -> None:
    """The gateway's choice for GenerateRequest.deterministic: engines in the mode only,
    UNAVAILABLE while they are down, FAILED_PRECONDITION when none serves the model."""

    async def scenario() -> None:
        pool = BackendPool([])
        for address, mode in (("127.0.0.1:1", False), ("127.0.0.1:2", True)):
            backend = Backend(address, None)
            backend.facts = EngineFacts("m", "m", 128, True, deterministic=mode)
            backend.healthy = True
            pool.backends[address] = backend
        relay = Relay(pool, RelaySettings(failover_wait_s=0.0))
        asked = _Attempt(deterministic=True, required=True)
        for i in range(16):
            chosen = await relay._choose("m", bytes([i]), asked)
            assert chosen.address == "127.0.0.1:2"
        anyone = {(await relay._choose("m", bytes([i]), _Attempt())).address for i in range(16)}
        assert anyone == {"127.0.0.1:1", "127.0.0.1:2"}  # without the flag: both
        pool.backends["127.0.0.1:2"].healthy = False
        with pytest.raises(GatewayError) as down:
            await relay._choose("m", b"x", asked)
        assert down.value.code == grpc.StatusCode.UNAVAILABLE
        del pool.backends["127.0.0.1:2"]
        with pytest.raises(GatewayError) as none:
            await relay._choose("m", b"x", asked)
        assert none.value.code == grpc.StatusCode.FAILED_PRECONDITION
        for backend in pool.backends.values():
            await backend.close()

    asyncio.run(scenario())
    # The OpenAI surface asks for it as a Tandem extra.
    assert completion_request({"prompt": "hi", "tandem": {"deterministic": True}}).deterministic
    assert not completion_request({"prompt": "hi"}).deterministic
