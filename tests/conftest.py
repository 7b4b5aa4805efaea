from __future__ import annotations

import os
import platform
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

# OpenBLAS reads its thread count once, when it loads. The suite runs dozens of engines and
# two workers on two cores: OpenBLAS's threads, one a core each by default, spin waiting for
# work the other processes hold the cores for (measured: a third of the CPU in system time
# on the engine tests, their wall time 24 s -> 17 s with one thread). Set for this process
# and every engine it starts, before the preload below.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Before anything imports mlx: the engine's BLAS, so in-test references compute alike.
import engine_service  # noqa: F401, I001, E402
from tandem_client import Checkpoint, EngineClient, StoreClient, Tensor
from tests.file_costs import heaviest_first
from tests.servers import (
    InProcessStore,
    ServiceProcess,
    free_port,
    serve_store,
    start_engine,
    start_store_on,
)

# NVIDIA publishes the NVRTC wheels tests/test_cuda_kernels.py compiles with for Linux x86_64
# only (pyproject.toml's markers): elsewhere that file is not collected.
collect_ignore = (
    [] if sys.platform == "linux" and platform.machine() == "x86_64" else ["test_cuda_kernels.py"]
)

# The engines tests start skip the warm-up (a second each on two cores, dozens of engines);
# test_engine_core.py starts one with it.
os.environ.setdefault("TANDEM_ENGINE_WARMUP", "0")
# Their shared-memory regions 64 MiB, not the CPU default's 256: each engine with a store
# maps its pages in at start (0.5 s of CPU for 256 MiB here), and the store its own mapping
# of them; the largest record a test moves through a region is ~10 MiB. The default's sizing
# is test_engine_domain's.
os.environ.setdefault("TANDEM_ENGINE_STORE_REGION_BYTES", str(64 << 20))


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_dir: Path) -> Iterator[InProcessStore]:
    """A fresh store of this test's own, served from this process (sync mode commit)."""
    with serve_store(store_dir) as served:
        yield served


@pytest.fixture
def client(store: InProcessStore) -> Iterator[StoreClient]:
    with StoreClient(store.address) as c:
        yield c


@pytest.fixture(scope="session")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessStore]:
    """One store for the session, for tests that change nothing in it (reads, rejected
    writes) and simulate no crash."""
    with serve_store(tmp_path_factory.mktemp("shared") / "store") as served:
        yield served


@pytest.fixture(scope="session")
def shared_client(shared_store: InProcessStore) -> Iterator[StoreClient]:
    with StoreClient(shared_store.address) as c:
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


def flip_stored_byte(data_dir: Path, chunk: int, at: int) -> None:
    """Corrupts a closed store's file through lmdb: one byte of its `chunk`-th stored chunk
    (in key order: record id, then chunk index)."""
    room = 2 * (data_dir / "data.mdb").stat().st_size + (64 << 20)  # the rewrite's pages
    env = lmdb.open(str(data_dir), max_dbs=8, map_size=room)
    try:
        with env.begin(write=True, db=env.open_db(b"chunks")) as txn:
            key, value = list(txn.cursor())[chunk]
            corrupted = bytearray(value)
            corrupted[at] ^= 0xFF
            txn.put(key, bytes(corrupted))
    finally:
        env.close()


@pytest.fixture(scope="session")
def engine_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data directory for the session: the embedded models are built once."""
    return tmp_path_factory.mktemp("engine-data")


@pytest.fixture(scope="session")
def engine(engine_data_dir: Path) -> Iterator[ServiceProcess]:
    proc = start_engine(engine_data_dir, "--max-running", "16")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def engine_client(engine: ServiceProcess) -> Iterator[EngineClient]:
    with EngineClient(engine.address) as c:
        yield c


@pytest.fixture(scope="session")
def reference(engine: ServiceProcess, engine_data_dir: Path):  # noqa: ANN201
    """The default model loaded in this process through mlx-lm, for comparisons."""
    from engine_service.model.loading import load_model

    return load_model("", engine_data_dir)


@pytest.fixture
def draft_stack(tmp_path: Path, engine_data_dir: Path) -> Iterator[dict[str, Any]]:
    """A store and an engine on it with the tiny draft model; `start_engine` starts another
    (after a kill), which the fixture stops in the end if it is put back under "engine"."""
    port = free_port()
    procs: dict[str, Any] = {"port": port, "root": tmp_path}
    procs["store"] = start_store_on(tmp_path / "store", port)

    def engine(*extra: str) -> ServiceProcess:
        return start_engine(
            engine_data_dir,
            "--store",
            f"127.0.0.1:{port}",
            "--draft-model",
            "tandem-tiny-draft",
            *extra,
            log_dir=tmp_path,
        )

    procs["start_engine"] = engine
    procs["engine"] = engine()
    try:
        yield procs
    finally:
        procs["engine"].stop()
        procs["store"].stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    heaviest_first(items)  # the longest files start first (tests/file_costs.py)


@pytest.fixture
def inprocess_store(store: InProcessStore) -> str:
    """The address of the test's own store (`store`: served from this process, its LMDB file
    under tmp_path), for domain tests of the engine's checkpoint code."""
    return store.address
