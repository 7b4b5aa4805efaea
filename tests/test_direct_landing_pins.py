"""Which pages of the store's data file a direct restore on MLX-CUDA reads from: BlockPins
(engine_service/checkpoints/direct_landing.py) keeps every block a restore needs registered
while it is planned, lets least recently used others go for room, and never goes over its
limit. Run here against a recording stand-in for the CUDA runtime (this machine has none),
over a real mapping of a real file; the gather itself is checked on the H200
(bench/direct_landing_check.py)."""

from __future__ import annotations

import os
from pathlib import Path

from engine_service.checkpoints.direct_landing import BLOCK, BlockPins
from tandem_client.data_file import DataFile


class RecordingCuda:
    """cudaHostRegister and friends as the driver checks them: no overlapping registrations,
    no unregistering what is not registered; and what was registered when."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # address -> bytes
        self.settled = 0
        self.refuse = False

    def register(self, address: int, nbytes: int, flags: int = 0) -> None:
        if self.refuse:
            raise RuntimeError("cudaHostRegister: out of memory")
        for start, size in self.registered.items():
            assert address + nbytes <= start or start + size <= address, "overlap"
        self.registered[address] = nbytes

    def unregister(self, address: int) -> None:
        assert address in self.registered, "not registered"
        del self.registered[address]

    def device_pointer(self, address: int) -> int:
        return address

    def settle(self) -> None:
        self.settled += 1


def _file(path: Path, blocks: float) -> DataFile:
    with open(path, "wb") as f:
        f.truncate(int(blocks * BLOCK))
    return DataFile(os.open(path, os.O_RDONLY))


def _covers(cuda: RecordingCuda, base: int, chunks: list[tuple[int, int]]) -> bool:
    def inside(at: int) -> bool:
        return any(s <= at < s + n for s, n in cuda.registered.items())

    return all(inside(base + o) and inside(base + o + n - 1) for o, n in chunks)


def test_a_restores_blocks_stay_registered_and_others_make_room(tmp_path: Path) -> None:
    cuda = RecordingCuda()
    pins = BlockPins(cuda, cuda.settle, limit=3 * BLOCK)
    data = _file(tmp_path / "data.mdb", 6)
    first = [(16, 1 << 20), (BLOCK + 4096, 1 << 20)]  # blocks 0 and 1
    assert pins.ensure(data, first) and _covers(cuda, data.base, first)
    spanning = [(2 * BLOCK - 4096, 8192)]  # across blocks 1 and 2
    assert pins.ensure(data, spanning) and _covers(cuda, data.base, spanning)
    assert set(pins.blocks) == {0, 1, 2}
    # Blocks 3 and 4: over the limit of three, so the least recently used (0) goes, not the
    # ones this restore needs, and never more than the limit stays registered.
    later = [(3 * BLOCK, 1 << 20), (4 * BLOCK, 1 << 20)]
    assert pins.ensure(data, later) and _covers(cuda, data.base, later)
    assert 0 not in pins.blocks and set(pins.blocks) == {2, 3, 4}
    assert sum(cuda.registered.values()) <= 3 * BLOCK
    assert cuda.settled >= 1  # no block went while a gather might still read it
    # Four blocks at once cannot fit three: refused, and what was registered stays consistent.
    wide = [(k * BLOCK, 1 << 20) for k in range(4)]
    assert not pins.ensure(data, wide)
    assert sum(cuda.registered.values()) <= 3 * BLOCK
    assert {data.base + k * BLOCK for k in pins.blocks} == set(cuda.registered)
    pins.let_go()
    assert not cuda.registered


def test_the_files_growing_tail_is_registered_again_longer_and_growth_in_the_background(
    tmp_path: Path,
) -> None:
    cuda = RecordingCuda()
    pins = BlockPins(cuda, cuda.settle, limit=8 * BLOCK)
    path = tmp_path / "data.mdb"
    data = _file(path, 2.5)
    tail = [(2 * BLOCK, 4096)]
    assert pins.ensure(data, tail) and pins.blocks[2] == BLOCK // 2  # what the file has
    with open(path, "r+b") as f:
        f.truncate(4 * BLOCK)  # LMDB grew the file
    further = [(2 * BLOCK + BLOCK // 2 + 16, 4096)]
    assert pins.ensure(data, further) and pins.blocks[2] == BLOCK
    assert _covers(cuda, data.base, tail + further)
    pins.grow(data)  # the registering thread's pass: every whole block
    assert set(pins.blocks) == {0, 1, 2, 3}
    past_the_end = [(5 * BLOCK, 4096)]
    assert not pins.ensure(data, past_the_end)  # a stale offset: nothing registered for it
    assert 5 not in pins.blocks


def test_a_refused_registration_turns_the_gather_off(tmp_path: Path) -> None:
    cuda = RecordingCuda()
    cuda.refuse = True
    pins = BlockPins(cuda, cuda.settle, limit=4 * BLOCK)
    data = _file(tmp_path / "data.mdb", 2)
    assert not pins.ensure(data, [(0, 4096)])
    assert pins.failed and not cuda.registered


def test_a_new_file_lets_the_old_ones_pages_go(tmp_path: Path) -> None:
    cuda = RecordingCuda()
    pins = BlockPins(cuda, cuda.settle, limit=4 * BLOCK)
    old = _file(tmp_path / "old.mdb", 1)
    assert pins.ensure(old, [(0, 4096)])
    new = _file(tmp_path / "new.mdb", 1)  # compacted: another file
    assert pins.ensure(new, [(0, 4096)])
    assert set(cuda.registered) == {new.base}
