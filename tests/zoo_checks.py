"""The model zoo's checks: each architecture through the engine's core, one row of the
support matrix (docs/models.md) per architecture.

In-process, the way the engine core runs a model: `load_model` (every held array evaluated,
upstream fixes applied), a `Scheduler` on its MLX thread (the start-up probe of what the
caches run), generation checkpoints and prefixes in a real store. mlx-lm's own solo decoding
(`generate_step`) is the reference. A cell is "yes", or "refused: <why>" where the engine
refuses that combination clearly (a request would get INVALID_ARGUMENT, not a wrong answer);
anything else is a failure the test reports.

tests/test_model_zoo_*.py run it and compare with the committed matrix;
`scripts/model_matrix.py` writes the matrix from the same run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step

from engine_service.checkpoints.manager import CheckpointManager, CheckpointSettings
from engine_service.core.planner import Planner
from engine_service.loop.limits import Limits
from engine_service.loop.scheduler import Scheduler
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.kv_codec import GROUP_SIZES, PLAIN_KV, KVCodec, request_layout
from engine_service.protocol.requests import DraftSupport, GenerationRequest, stop_token_ids
from engine_service.protocol.sampling_options import SamplingOptions
from tests.generation_rows import Collector
from tests.model_zoo import build_zoo_model

TOKENS = 16
# Prompt lengths of one batch: long enough to wrap the zoo's 32-token windows, uneven so
# that rows are padded.
LENGTHS = (100, 41, 7, 66)
PREFIX_PROMPT = 200  # three blocks and some: a prefix worth keeping


@dataclass(frozen=True)
class ZooRow:
    """One architecture's row of the support matrix."""

    arch: str
    layout: str
    greedy: str = ""  # one row alone equals mlx-lm's solo decoding
    batched: str = ""  # rows of uneven lengths in one batch each equal their solo decoding
    resume: str = ""  # a generation resumed from its first checkpoint equals the whole run
    prefix: str = ""  # a prompt sent again restores a cached prefix
    affine_kv: str = ""  # 8- and 4-bit rows beside a plain one, each equal to itself alone
    turboquant_kv: str = ""  # the same with TurboQuant 4/4 and 3/2 rows

    def cells(self) -> list[str]:
        """The row as the matrix's cells (a "|" in a reason would split a Markdown cell)."""
        return [str(getattr(self, f.name)).replace("|", "/") for f in fields(self)]

    @staticmethod
    def columns() -> list[str]:
        return [f.name for f in fields(ZooRow)]


def prompt_of(length: int, seed: int, vocab: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (vocab - 3) + 3 for i in range(length)]


def request(
    loaded: LoadedModel, rid: str, prompt: list[int], kv: KVCodec = PLAIN_KV, **extra: Any
) -> GenerationRequest:
    options = SamplingOptions(ignore_eos=True)
    return GenerationRequest(
        request_id=rid,
        prompt=prompt,
        max_tokens=extra.pop("max_tokens", TOKENS),
        sampling=options,
        namespace=extra.pop("namespace", "zoo"),
        stop_ids=stop_token_ids(options, loaded.eos_token_ids),
        kv=kv,
        layout=request_layout(loaded.layout, kv),
        **extra,
    )


class Engine:
    """A model's scheduler (and checkpoints in the store at `store`), as the core runs them."""

    def __init__(self, loaded: LoadedModel, store: str) -> None:
        self.loaded = loaded
        # No shared-memory region: several engines share this process, and a store knows
        # one region plane per caller process.
        settings = CheckpointSettings(store=store, store_region_bytes=0)
        self.checkpoints = CheckpointManager(loaded, settings)
        self.scheduler = Scheduler(
            loaded, Limits(max_running=8, max_queued=8), checkpoints=self.checkpoints
        )
        self.scheduler.start()
        self.planner = Planner(self.checkpoints, DraftSupport())

    def run(self, requests: list[GenerationRequest], refusals: bool = False) -> list[Collector]:
        """Submits them together (one batch) and waits for each to finish (by length or
        stop; or, with refusals, refused)."""
        sinks = []
        for r in requests:
            sink = Collector()
            self.scheduler.submit(r, sink, self.planner.plan(r) if self.planner.needed(r) else None)
            sinks.append(sink)
        for sink in sinks:
            end = sink.wait(120.0)
            refused = refusals and end.reason == "error" and end.failure == "InvalidRequest"
            if end.reason not in ("length", "stop") and not refused:
                raise AssertionError(f"{end.reason}: {end.error}")
        return sinks

    def close(self) -> None:
        self.scheduler.shutdown()
        self.checkpoints.close()


def solo_reference(loaded: LoadedModel, prompt: list[int], n: int = TOKENS) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=n)]


def check_architecture(arch: str, models: Path, data: Path, store: str) -> ZooRow:
    """Every column for one architecture; raises AssertionError on a wrong answer."""
    loaded = load_model(str(build_zoo_model(arch, models)), data)
    engine = Engine(loaded, store)
    try:
        caps = loaded.capabilities
        vocab = loaded.vocab_size
        prompts = [prompt_of(n, i, vocab) for i, n in enumerate(LENGTHS)]
        reference = [solo_reference(loaded, p) for p in prompts]
        alone = engine.run([request(loaded, f"{arch}-alone", prompts[0])])[0]
        _same(alone.tokens, reference[0], "one row alone vs mlx-lm")
        batch = engine.run([request(loaded, f"{arch}-b{i}", p) for i, p in enumerate(prompts)])
        for i, sink in enumerate(batch):
            _same(sink.tokens, reference[i], f"batched row {i} ({LENGTHS[i]} tokens) vs solo")
        return ZooRow(
            arch=arch,
            layout=" ".join(sorted(set(loaded.layout))),
            greedy="yes",
            batched="yes",
            resume=_resume(engine, loaded, store, prompts[1]),
            prefix=_prefix(engine, loaded, arch),
            affine_kv=_quantized(engine, loaded, _affine_codecs(caps.kv_widths)),
            turboquant_kv=_quantized(
                engine, loaded, [KVCodec.turboquant(4, 4), KVCodec.turboquant(3, 2)]
            ),
        )
    finally:
        engine.close()


def _resume(engine: Engine, loaded: LoadedModel, store: str, prompt: list[int]) -> str:
    """Stopped after its first tokens (no interval reached: only the first snapshot exists),
    resumed by a fresh engine on the same store."""
    n = 40
    r = request(loaded, "resume", prompt, max_tokens=n, checkpoint_interval=1000)
    sink = Collector()
    engine.scheduler.submit(r, sink)
    deadline = time.monotonic() + 60
    while len(sink.tokens) < 3:
        assert time.monotonic() < deadline, "no tokens"
        time.sleep(0.005)
    engine.scheduler.cancel(r.request_id, keep_checkpoint=True)
    sink.wait(120.0)
    assert engine.checkpoints.flush().durable
    fresh = Engine(loaded, store)
    try:
        again = request(loaded, "resume", prompt, max_tokens=n, checkpoint_interval=1000)
        again.resume = True
        plan = fresh.planner.plan(again)
        assert plan is not None, "no generation checkpoint after the first tokens"
        replay = plan.replay  # type: ignore[union-attr]
        resumed = Collector()
        fresh.scheduler.submit(again, resumed, plan)
        resumed.wait(120.0)
    finally:
        fresh.close()
    _same(replay + resumed.tokens, solo_reference(loaded, prompt, n), "resumed vs whole run")
    return "yes"


def _prefix(engine: Engine, loaded: LoadedModel, arch: str) -> str:
    prompt = prompt_of(PREFIX_PROMPT, 99, loaded.vocab_size)
    first = engine.run([request(loaded, f"{arch}-p1", prompt)])[0]
    again = engine.run([request(loaded, f"{arch}-p2", prompt)])[0]
    _same(again.tokens, first.tokens, "a prompt sent again")
    cached = again.started.cached_prompt_tokens
    if cached:
        return "yes"
    why = getattr(again.started, "prefix_miss_reason", "") or "no reason given"
    return f"refused: {why}"


def _affine_codecs(widths: tuple[int, ...]) -> list[KVCodec]:
    group = next((g for g in GROUP_SIZES if all(w % g == 0 for w in widths)), 64)
    return [KVCodec(8, group), KVCodec(4, group)]


def _quantized(engine: Engine, loaded: LoadedModel, codecs: list[KVCodec]) -> str:
    """Quantized rows beside a plain one, each equal to itself alone; or the refusal the
    core answers them with (INVALID_ARGUMENT, before they join the batch)."""
    prompt = prompt_of(LENGTHS[0], 5, loaded.vocab_size)
    plain = request(loaded, "q-plain", prompt_of(LENGTHS[1], 6, loaded.vocab_size))
    rows = [request(loaded, f"q-{i}", prompt, codec) for i, codec in enumerate(codecs)]
    together = engine.run([plain, *rows], refusals=True)
    ends = [sink.wait(120.0) for sink in together]
    assert ends[0].reason == "length", "a plain row beside refused ones completes"
    refused = [end for end in ends[1:] if end.reason == "error"]
    if refused:
        assert all(end.failure == "InvalidRequest" and end.error for end in refused), refused
        assert len(refused) == len(rows), "one scheme: refused alike"
        assert not any(sink.tokens for sink in together[1:]), "refused before any token"
        return f"refused: {refused[0].error}"
    for i, row in enumerate(rows):
        # Its own namespace: not a prefix the batched row saved (a restored quantized prefix
        # gives its first token from quantized attention, a prefill from plain attention).
        own = request(loaded, f"q-alone-{i}", prompt, row.kv, namespace=f"alone-{i}")
        alone = engine.run([own])[0]
        cached = (together[i + 1].started.cached_prompt_tokens, alone.started.cached_prompt_tokens)
        _same(
            together[i + 1].tokens,
            alone.tokens,
            f"{row.kv.signature()} batched vs alone (cached prompt tokens {cached})",
        )
    return "yes"


def _same(got: list[int], want: list[int], what: str) -> None:
    if got != want:
        pairs = zip(got, want, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(got), len(want)))
        raise AssertionError(f"{what}: differs at token {first} of {len(want)}: {got} != {want}")


# -- the matrix in docs/models.md ----------------------------------------------------------

MATRIX_START = "<!-- zoo matrix: written by scripts/model_matrix.py -->"
MATRIX_END = "<!-- end of zoo matrix -->"


def matrix_lines(rows: list[ZooRow]) -> list[str]:
    header = ZooRow.columns()
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(row.cells()) + " |")
    return lines


def committed_rows(doc: Path) -> dict[str, list[str]]:
    """The matrix rows docs/models.md holds, by architecture."""
    text = doc.read_text(encoding="utf-8")
    table = text.split(MATRIX_START, 1)[1].split(MATRIX_END, 1)[0]
    rows: dict[str, list[str]] = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells
    return rows
