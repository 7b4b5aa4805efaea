"""The Tandem checkpoint store: LMDB-backed, served over gRPC. Never imports mlx."""
