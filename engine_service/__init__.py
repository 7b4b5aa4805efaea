"""The Tandem engine: mlx-lm generation with continuous batching, served over gRPC."""

from engine_service import blas, transformers_import

# Before anything imports mlx (see blas.py) or transformers (see transformers_import.py).
blas.preload()
transformers_import.install()
