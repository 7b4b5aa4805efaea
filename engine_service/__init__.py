"""The Tandem engine: mlx-lm generation with continuous batching, served over gRPC."""

from engine_service import blas

# Before anything imports mlx (see blas.py).
blas.preload()
