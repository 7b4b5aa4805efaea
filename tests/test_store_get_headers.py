"""Store.GetHeaders: several records' headers in one call (a resume probes a checkpoint
chain's 16 candidate segments with it, tests/test_engine_domain.py).

- Headers come back in the order asked, each found or not, equal to a Get of the header.
- More than 64 keys is INVALID_ARGUMENT.
- A store of the release before (no GetHeaders) is asked a Get a key, with the same answers.
- Tenancy and role: tests/test_store_writer_role.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from store_service.servicer import MAX_HEADER_KEYS
from tandem_client import StoreClient
from tandem_client.errors import InvalidArgument
from tests.conftest import make_checkpoint
from tests.older_store import serve_store_without


def _same_header(got: Any, want: Any) -> None:
    assert got is not None
    assert (got.key, got.token_ids, got.metadata) == (want.key, want.token_ids, want.metadata)
    assert [(t.name, t.shape, t.nbytes, t.crc32) for t in got.tensors] == [
        (t.name, t.shape, t.nbytes, t.crc32) for t in want.tensors
    ]


def _answers_in_order(client: StoreClient) -> None:
    for i in range(3):
        client.put(make_checkpoint(b"h%d" % i, {"k_int8": 300 + i}))
    keys = [b"h2", b"missing", b"h0", b"h1", b"h0"]
    reads = client.get_headers(keys)
    assert [r.checkpoint is not None for r in reads] == [True, False, True, True, True]
    assert not any(r.damaged for r in reads)
    for key, read in zip(keys, reads, strict=True):
        if read.checkpoint is not None:
            _same_header(read.checkpoint, client.get_header(key))


def test_headers_come_back_in_the_order_asked(client: StoreClient) -> None:
    _answers_in_order(client)
    assert client.get_headers([]) == []


def test_more_than_the_bound_of_keys_is_invalid_argument(client: StoreClient) -> None:
    with pytest.raises(InvalidArgument):
        client.get_headers([b"k%d" % i for i in range(MAX_HEADER_KEYS + 1)])


@pytest.fixture
def older_store(tmp_path: Path) -> Iterator[str]:
    with serve_store_without(tmp_path / "old", "GetHeaders") as address:
        yield address


def test_a_store_without_get_headers_is_asked_a_get_a_key(older_store: str) -> None:
    with StoreClient(older_store) as client:
        _answers_in_order(client)
        assert not client._get_headers_known
