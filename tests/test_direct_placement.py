"""A direct Get's placement split into each tensor's chunks (tandem_client/direct.py), and the
placements that do not fit their header refused as DATA_LOSS (in-process)."""

from __future__ import annotations

import pytest

from tandem_client.direct import chunks_by_tensor
from tandem_client.errors import DataLoss
from tandem_client.records import Tensor
from tandem_wire.pb import store_pb2


def _tensor(nbytes: int) -> Tensor:
    return Tensor("t", "uint8", (nbytes,), b"", stored_nbytes=nbytes)


def _placement(lengths: list[int]) -> store_pb2.DirectPlacement:
    offsets = [4096 * i for i in range(len(lengths))]
    return store_pb2.DirectPlacement(chunk_offsets=offsets, chunk_lengths=lengths)


def test_each_tensor_gets_its_own_chunks_in_order_empty_ones_none() -> None:
    tensors = [_tensor(0), _tensor(5), _tensor(0), _tensor(3), _tensor(0)]
    split = chunks_by_tensor(tensors, _placement([2, 3, 3]))
    assert [split[id(t)] for t in tensors] == [[], [(0, 2), (4096, 3)], [], [(8192, 3)], []]


@pytest.mark.parametrize(
    "lengths",
    [[2, 2, 4], [5, 2], [5, 0, 3], [5], [6, 2]],
    ids=["straddles", "short", "empty chunk", "missing", "overruns"],
)
def test_a_placement_that_does_not_fit_its_tensors_is_data_loss(lengths: list[int]) -> None:
    with pytest.raises(DataLoss):
        chunks_by_tensor([_tensor(5), _tensor(3)], _placement(lengths))
