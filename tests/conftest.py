from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem_client import Checkpoint, StoreClient, Tensor
from tests.servers import ServiceProcess, start_store


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_dir: Path) -> Iterator[ServiceProcess]:
    proc = start_store(store_dir, "--sync-mode", "commit")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(store: ServiceProcess) -> Iterator[StoreClient]:
    with StoreClient(store.address) as c:
        yield c


def make_checkpoint(key: bytes, sizes: dict[str, int], **fields: object) -> Checkpoint:
    """A checkpoint of random tensors; names ending in _bf16 are bfloat16-sized."""
    tensors = []
    for name, nbytes in sizes.items():
        data = os.urandom(nbytes)
        if name.endswith("_bf16"):
            tensors.append(Tensor(name, "bfloat16", (nbytes // 2,), data))
        else:
            tensors.append(Tensor(name, "int8", (nbytes,), data))
    fields.setdefault("model_id", "test-model@0")
    fields.setdefault("layout", ["kv:plain"])
    return Checkpoint(key=key, tensors=tensors, **fields)  # type: ignore[arg-type]


def payload_crc(checkpoint: Checkpoint) -> list[int]:
    return [zlib.crc32(memoryview(t.data)) for t in checkpoint.all_tensors()]
