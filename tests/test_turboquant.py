"""The TurboQuant codec (engine_service/kv/turboquant.py) in-process: its codebook is the
Gaussian Lloyd-Max quantizer, a round trip's error stays within the paper's bound at every
bit width, packing loses nothing, the same seed encodes alike, and attention over encoded
keys and values in the rotated domain matches float attention within a stated tolerance."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine_service.kv import turboquant
from engine_service.kv.turboquant import BITS, TurboQuantCodec, distortion_bound, rotated_attention
from engine_service.kv.turboquant_codebooks import (
    FROZEN_CODEBOOKS,
    gaussian_codebook,
    lloyd_max_codebook,
)

# A unit vector's mean squared error: the paper's ~0.117, 0.03 and 0.009 are the Gaussian
# Lloyd-Max distortions (Max, 1960), to more digits here.
PAPER_MSE = {2: 0.1175, 3: 0.03455, 4: 0.009497}


def test_the_codebook_is_gaussian_lloyd_max() -> None:
    centroids, bounds = gaussian_codebook(2)
    # The 2-bit Lloyd-Max quantizer of N(0, 1): +-0.4528, +-1.5104 (Max, 1960).
    assert np.allclose(centroids, [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-3)
    assert np.allclose(bounds, [-0.9816, 0.0, 0.9816], atol=1e-3)
    one_bit, _ = gaussian_codebook(1)
    assert np.allclose(one_bit, [-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)], atol=1e-4)


@pytest.mark.parametrize("bits", [2, 4])
def test_the_frozen_codebooks_are_what_lloyds_iteration_computes(bits: int) -> None:
    # Stored codes decode with the frozen table, whatever the machine. The iteration recomputes
    # it to the last bits or so: numpy's exp differs by an ulp between CPUs' SIMD paths (an
    # AVX-512 machine moved the 2-bit table's first centroid by 5e-16), which no code can see.
    frozen_centroids, frozen_bounds = FROZEN_CODEBOOKS[bits]
    centroids, bounds = lloyd_max_codebook(bits)
    assert np.allclose(frozen_centroids, centroids, rtol=0, atol=1e-12)
    assert np.allclose(frozen_bounds, bounds, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bits", BITS)
def test_round_trip_error_is_within_the_papers_bound(bits: int) -> None:
    codec = TurboQuantCodec(128, bits, seed=3)
    x = mx.random.normal((4096, 128), key=mx.random.key(bits))
    x = x / mx.linalg.norm(x, axis=-1, keepdims=True)
    mse = float(mx.mean(mx.sum((codec.decode(codec.encode(x)) - x) ** 2, axis=-1)))
    assert mse <= distortion_bound(bits)
    assert mse <= PAPER_MSE[bits] * 1.05, (bits, mse)
    # Norms are kept: a vector 7 times longer has 49 times the squared error, no more.
    planes = codec.encode(7 * x)
    scaled = float(mx.mean(mx.sum((codec.decode(planes) - 7 * x) ** 2, axis=-1)))
    assert scaled == pytest.approx(49 * mse, rel=1e-3)


@pytest.mark.parametrize(("head_dim", "bits"), [(128, 3), (80, 3), (64, 4), (96, 2)])
def test_packing_keeps_every_index_and_a_seed_encodes_alike(head_dim: int, bits: int) -> None:
    codec = TurboQuantCodec(head_dim, bits, seed=11)
    x = mx.random.normal((2, 3, 17, head_dim), key=mx.random.key(0))
    planes = codec.encode(x)
    assert planes.codes.dtype == mx.uint32
    assert planes.codes.shape == (2, 3, 17, -(-head_dim // (32 // bits)))
    y = codec.rotate(x) / planes.norms
    expected = np.searchsorted(np.array(codec.bounds), np.array(y), side="left")
    assert np.array_equal(np.array(codec._unpack(planes.codes)), expected)
    again = TurboQuantCodec(head_dim, bits, seed=11).encode(x)
    assert np.array_equal(np.array(again.codes), np.array(planes.codes))
    other = TurboQuantCodec(head_dim, bits, seed=12).encode(x)
    assert not np.array_equal(np.array(other.codes), np.array(planes.codes))
    rotation = np.array(codec.rotation)
    assert np.allclose(rotation @ rotation.T, np.eye(head_dim), atol=1e-5)


@pytest.mark.parametrize(("key_bits", "value_bits"), [(4, 4), (3, 3), (2, 2), (4, 2), (3, 4)])
def test_rotated_domain_attention_matches_float_attention(key_bits: int, value_bits: int) -> None:
    """Relative L2 error of the attention output against float attention over the same keys
    and values (8 query heads over 2 KV heads, 256 positions, causal), within the keys' and
    values' relative errors added in quadrature: sqrt(D(key bits) + D(value bits))."""
    tolerance = math.sqrt(PAPER_MSE[key_bits] + PAPER_MSE[value_bits])
    shape = (2, 2, 256, 128)
    rng = mx.random.key(5)
    k1, k2, k3 = mx.random.split(rng, 3)
    queries = mx.random.normal((2, 8, 256, 128), key=k1)
    keys = mx.random.normal(shape, key=k2)
    values = mx.random.normal(shape, key=k3)
    scale = 1 / math.sqrt(128)
    mask = mx.tril(mx.ones((256, 256), dtype=mx.bool_))
    reference = mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask="causal"
    )
    kc, vc = TurboQuantCodec(128, key_bits, seed=1), TurboQuantCodec(128, value_bits, seed=2)
    out = rotated_attention(queries, kc.encode(keys), vc.encode(values), kc, vc, scale, mask)
    error = float(mx.linalg.norm(out - reference) / mx.linalg.norm(reference))
    assert error <= tolerance, error
    # The same attention over decoded (un-rotated) keys and values: rotation is exact.
    decoded = mx.fast.scaled_dot_product_attention(
        queries, kc.decode(kc.encode(keys)), vc.decode(vc.encode(values)), scale=scale,
        mask="causal",
    )  # fmt: skip
    assert float(mx.max(mx.abs(out - decoded))) < 1e-4


def test_the_fused_kernels_check_out_of_memory_decides_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fused decode kernel's one check against the reference path (MLX-CUDA) switches
    it off for the process when the kernel cannot run; the device out of memory during the
    check raises instead (the step fails and runs again), leaving it to be checked later."""

    def raising(message: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(message)

        return call

    fused, reference = mx.zeros((4,)), mx.zeros((4,))
    # mlx.core's abs, which the check calls (monkeypatch puts it back)
    monkeypatch.setattr(mx, "abs", raising("cudaMallocAsync failed: out of memory"))
    with pytest.raises(RuntimeError, match="out of memory"):
        turboquant._fused_matches(fused, reference)
    monkeypatch.setattr(mx, "abs", raising("no kernel for this primitive"))
    assert turboquant._fused_matches(fused, reference) is False
