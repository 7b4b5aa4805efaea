"""engine_service/model/upstream_fixes.py: each fix is still needed (mlx-lm's own code still gets it
wrong; when that test fails, mlx-lm has fixed it: drop the fix) and, applied, it is right."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.utils import load

from engine_service.model import upstream_fixes
from engine_service.model.default_model import build_model_dir

NEMOTRON_H: dict[str, Any] = {
    "model_type": "nemotron_h",
    "hybrid_override_pattern": list("M*M-"),
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "attention_bias": False,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "mamba_proj_bias": False,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "n_groups": 2,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-5,
    "use_bias": False,
    "use_conv_bias": True,
    "tie_word_embeddings": False,
}
# Different lengths, so each row but the longest is padded by a different amount; the last
# is a one-token prompt (nothing to prefill).
PROMPTS = [[(7 * i + 3 * j) % 2000 + 5 for j in range(n)] for i, n in enumerate([3, 9, 14, 5, 1])]
N = 16
FIX = next(f for f in upstream_fixes.FIXES if f.name == "nemotron_h-ssm-lengths")

Rows = list[tuple[list[int], list[mx.array]]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("nemotron_h")
    build_model_dir(NEMOTRON_H, Path(out))
    model = load(str(out))[0]
    # A long memory (decay ~0.94 a step), as trained models have: at the init's A the state
    # fades within a couple of tokens and a lost prompt state would hardly show in the tokens.
    for layer in model.layers:
        if layer.block_type == "M":
            layer.mixer.A_log = mx.full(layer.mixer.A_log.shape, -3.0)
    return model


def _upstream() -> pytest.MonkeyPatch:
    mp = pytest.MonkeyPatch()
    mp.setattr(FIX.target(), FIX.method, FIX.upstream())
    return mp


@pytest.fixture
def upstream() -> Iterator[None]:
    """mlx-lm's own method for the test, whatever was installed before (restored after)."""
    mp = _upstream()
    yield
    mp.undo()


def solo(model: Any) -> Rows:
    rows: Rows = []
    for prompt in PROMPTS:
        steps = zip(generate_step(mx.array(prompt), model, max_tokens=N), range(N), strict=False)
        tokens, logprobs = zip(*[(int(t), lp) for (t, lp), _ in steps], strict=True)
        rows.append((list(tokens), list(logprobs)))
    return rows


def batched(model: Any) -> Rows:
    """The prompts as one batch in mlx-lm's BatchGenerator, as the engine runs them."""
    bg = BatchGenerator(model, completion_batch_size=16, prefill_batch_size=16)
    uids = bg.insert(PROMPTS, max_tokens=[N] * len(PROMPTS))
    rows: dict[int, tuple[list[int], list[mx.array]]] = {u: ([], []) for u in uids}
    while any(len(rows[u][0]) < N for u in uids):
        for r in bg.next()[1]:
            rows[r.uid][0].append(r.token)
            rows[r.uid][1].append(r.logprobs)
    return [rows[u] for u in uids]


@pytest.fixture(scope="module")
def reference(model: Any) -> Rows:
    """Each prompt decoded alone by mlx-lm's own code: what a batch must reproduce."""
    mp = _upstream()
    try:
        return solo(model)
    finally:
        mp.undo()


def test_registry() -> None:
    # A new fix needs its own still-needed test below.
    assert [f.name for f in upstream_fixes.FIXES] == ["nemotron_h-ssm-lengths"]
    assert all(f.why for f in upstream_fixes.FIXES)


def test_nemotron_h_batched_rows_still_broken_upstream(
    model: Any, reference: Rows, upstream: None
) -> None:
    assert not FIX.applied()
    got = batched(model)
    wrong = [i for i, (row, ref) in enumerate(zip(got, reference, strict=True)) if row[0] != ref[0]]
    assert wrong, (
        "mlx-lm now decodes nemotron_h's padded batch rows like solo ones: drop the "
        f"{FIX.name!r} fix from engine_service/model/upstream_fixes.py"
    )
    assert set(wrong) <= {0, 1, 3}  # padded rows: not the longest, nor the one-token one


def test_nemotron_h_batched_rows_equal_solo_with_fix(
    model: Any, reference: Rows, upstream: None
) -> None:
    upstream_fixes.apply(model)
    upstream_fixes.apply(model)  # idempotent
    assert FIX.applied()
    # Solo decoding is the same computation as upstream's, bit for bit.
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(solo(model), reference, strict=True):
        assert tokens == ref_tokens
        assert all(mx.array_equal(a, b).item() for a, b in zip(logprobs, ref_logprobs, strict=True))
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(
        zip(batched(model), reference, strict=True)
    ):
        assert tokens == ref_tokens, f"row {i} (prompt of {len(PROMPTS[i])})"
        for a, b in zip(logprobs, ref_logprobs, strict=True):
            assert mx.allclose(a, b, atol=1e-5).item(), f"row {i}"


def test_apply_leaves_other_architectures(upstream: None) -> None:
    upstream_fixes.apply(object())
    assert not FIX.applied()
