"""Quantized rows joining a prompt batch that already holds another row's columns.

mlx-lm's BatchGenerator extends its prompt batch with new rows before it splits off the rows
whose prompt is done: a row arriving one step after another (that one prefilled, its last
token not yet fed) joins a batch whose planes already hold columns, and holds only left
padding there until its own prefill. A quantized ring row must stay plain through that
prefill, as alone (it converts after its first call); it used to convert at once, so its
prompt attended over quantized keys: greedy tokens differed from its run alone (TurboQuant
from the first token). Seen on the zoo's gemma3_text under CPU load, where the arrival
timing made it so; here the timing is fixed by stepping the batch by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from engine_service.kv.batch_cache import adopt_row
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.kv_codec import PLAIN_KV, KVCodec
from tests.batch_rows import alone

N = 12


@pytest.fixture(scope="module")
def swa(engine_data_dir: Path) -> LoadedModel:
    """tandem-tiny-swa: layers alternate a 64-token ring and full attention."""
    return load_model("tandem-tiny-swa", engine_data_dir)


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (vocab - 3) + 3 for i in range(length)]


def _joining_after(
    model: Any, first: list[int], later: list[int], codecs: list[KVCodec], steps: int
) -> tuple[list[list[int]], list[list[mx.array]]]:
    """A plain row alone for `steps` batch steps, then rows of `codecs` inserted: their
    tokens and logprobs."""
    bg = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)

    def row(codec: KVCodec) -> list[Any]:
        return [adopt_row(c, codec) for c in make_prompt_cache(model)]

    bg.insert([first], max_tokens=[N], caches=[row(PLAIN_KV)])
    for _ in range(steps):
        bg.next()
    uids = bg.insert(
        [later] * len(codecs), max_tokens=[N] * len(codecs), caches=[row(k) for k in codecs]
    )
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    logprobs: dict[int, list[mx.array]] = {u: [] for u in uids}
    while any(len(tokens[u]) < N for u in uids):
        for r in bg.next()[1]:
            if r.uid in tokens:
                tokens[r.uid].append(r.token)
                logprobs[r.uid].append(r.logprobs)
    return [tokens[u] for u in uids], [logprobs[u] for u in uids]


@pytest.mark.parametrize(
    "codecs",
    [
        [KVCodec(8, 32), KVCodec(4, 32)],
        [KVCodec.turboquant(4, 4), KVCodec.turboquant(2, 2)],
    ],
    ids=["affine", "turboquant"],
)
@pytest.mark.parametrize("steps", [0, 1, 2], ids=lambda s: f"after-{s}-steps")
def test_quantized_rows_joining_a_prompt_batch_decode_as_alone(
    swa: LoadedModel, codecs: list[KVCodec], steps: int
) -> None:
    # The first row is longer than the 64-token window (its ring wrapped in its prefill);
    # one step in, it sits prefilled in the prompt batch the new rows join (the zoo's case).
    vocab = swa.vocab_size
    first, later = _prompt(90, 6, vocab), _prompt(100, 5, vocab)
    tokens, logprobs = _joining_after(swa.model, first, later, codecs, steps)
    for codec, got, got_lp in zip(codecs, tokens, logprobs, strict=True):
        want, want_lp = alone(swa.model, later, N, codec)
        assert got == want, codec.signature()
        worst = max(float(mx.abs(a - b).max()) for a, b in zip(got_lp, want_lp, strict=True))
        assert worst < 1e-3, (codec.signature(), worst)
