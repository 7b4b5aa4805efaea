"""TurboQuant's scalar codebooks: the Lloyd-Max quantizers of N(0, 1) at 2-4 bits.

Computed once by Lloyd's iteration and frozen here, because a checkpoint's codes must decode
with exactly these values on every machine, and computing them cost every engine process
1-1.6 s a bit width.
"""

from __future__ import annotations

import functools
import math

import numpy as np

# gaussian_codebook's values at the codec's bit widths, as lloyd_max_codebook computes them
# (1-1.6 s each, paid by every engine that probes TurboQuant at start-up otherwise);
# tests/test_turboquant.py recomputes them (to ~1e-15: numpy's exp can differ by an ulp from one
# CPU's SIMD path to another's): a checkpoint's codes decode with exactly these, everywhere.
FROZEN_CODEBOOKS: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = {
    2: (
        (
            -1.5103706258820557,
            -0.452746554128478,
            0.4527834782058465,
            1.5104025751866048,
        ),
        (
            -0.9815585900052668,
            1.8462038684274873e-05,
            0.9815930266962256,
        ),
    ),
    3: (
        (
            -2.1518174726923402,
            -1.3437738870016196,
            -0.7558978657356484,
            -0.24504187961278898,
            0.24508105226790627,
            0.7559368786310133,
            1.343812360620696,
            2.1518522493443526,
        ),
        (
            -1.74779567984698,
            -1.049835876368634,
            -0.5004698726742187,
            1.9586327558648864e-05,
            0.5005089654494598,
            1.0498746196258546,
            1.7478323049825244,
        ),
    ),
    4: (
        (
            -2.7321694424884577,
            -2.068532363168173,
            -1.6175372316127892,
            -1.2557246117813043,
            -0.9418688350217034,
            -0.6563681151851962,
            -0.38777962070314276,
            -0.12828581566975925,
            0.12832559422540357,
            0.38781938897473234,
            0.6564078604266873,
            0.9419085377529643,
            1.2557642362006363,
            1.6175766959285844,
            2.0685714051063058,
            2.732205707096064,
        ),
        (
            -2.4003509028283156,
            -1.843034797390481,
            -1.4366309216970468,
            -1.098796723401504,
            -0.7991184751034498,
            -0.5220738679441694,
            -0.258032718186451,
            1.988927782216321e-05,
            0.25807249160006795,
            0.5221136247007099,
            0.7991581990898258,
            1.0988363869768003,
            1.4366704660646104,
            1.843074050517445,
            2.400388556101185,
        ),
    ),
}


def gaussian_codebook(bits: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The codec's Lloyd-Max codebook at b bits: frozen at 2-4 bits, computed otherwise."""
    return FROZEN_CODEBOOKS.get(bits) or lloyd_max_codebook(bits)


@functools.lru_cache(maxsize=8)
def lloyd_max_codebook(bits: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Lloyd-Max centroids of N(0, 1) at b bits and the boundaries between them (midpoints),
    by Lloyd's iteration over a fine grid of the density. Equal on every machine to ~1e-15
    only (numpy's exp varies by an ulp between SIMD paths): codes decode with FROZEN_CODEBOOKS."""
    grid = np.linspace(-8.0, 8.0, 400_001)
    weight = np.exp(-0.5 * grid**2)
    levels = 2**bits
    # Start at the quantiles' midpoints; 300 rounds move the centroids below 1e-9.
    centroids = np.sqrt(2) * _erfinv(np.linspace(-1, 1, levels + 2)[1:-1])
    for _ in range(300):
        bounds = (centroids[1:] + centroids[:-1]) / 2
        cell = np.searchsorted(bounds, grid)
        mass = np.bincount(cell, weight, levels)
        centroids = np.bincount(cell, weight * grid, levels) / mass
    bounds = (centroids[1:] + centroids[:-1]) / 2
    return tuple(float(c) for c in centroids), tuple(float(b) for b in bounds)


def _erfinv(y: np.ndarray) -> np.ndarray:
    """Inverse error function by Newton's method on math.erf (numpy has none)."""
    x = np.zeros_like(y)
    erf = np.vectorize(math.erf)
    for _ in range(60):
        x = x - (erf(x) - y) / (2 / math.sqrt(math.pi) * np.exp(-(x**2)))
    return x
