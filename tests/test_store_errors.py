"""Bad input gets the right status and changes nothing."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import grpc
import pytest

from store_service import errors
from store_service.errors import status_of, status_on_error
from tandem_client import Checkpoint, StoreClient, TandemError, Tensor
from tandem_wire.pb import store_pb2, tensors_pb2
from tests.conftest import make_checkpoint

MiB = 1 << 20


def _messages(ckpt: Checkpoint, chunks: list[tuple[int, bytes]]) -> Iterator[store_pb2.PutRequest]:
    yield store_pb2.PutRequest(header=store_pb2.PutHeader(checkpoint=ckpt.header_pb()))
    for offset, data in chunks:
        yield store_pb2.PutRequest(chunk=tensors_pb2.Chunk(offset=offset, data=data))


def _status(client: StoreClient, requests: Iterator[store_pb2.PutRequest]) -> grpc.StatusCode:
    try:
        client._store.Put(requests, timeout=30)  # the raw stub: these are protocol errors
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def seeded(shared_client: StoreClient) -> StoreClient:
    """The session's shared store with one record: every test here must leave it as is."""
    shared_client.put(make_checkpoint(b"existing", {"kv_int8": 2 * MiB}))
    shared_client.flush()
    return shared_client


def _unchanged(client: StoreClient, before: store_pb2.StatsResponse) -> None:
    client.flush()  # aborted puts clean up on the writer thread; wait for it
    after = client.stats()
    assert (after.records, after.payload_bytes, after.chunk_entries, after.pending_puts) == (
        before.records,
        before.payload_bytes,
        before.chunk_entries,
        0,
    )


def test_bad_puts_are_rejected_and_change_nothing(seeded: StoreClient) -> None:
    client = seeded
    before = client.stats()
    ckpt = make_checkpoint(b"new", {"a_int8": 3 * MiB, "b_int8": MiB})
    data = b"".join(bytes(t.data) for t in ckpt.tensors)
    chunk = [(i, data[i : i + MiB]) for i in range(0, len(data), MiB)]
    bad = tensors_pb2.Chunk(offset=0, data=b"x")

    cases = {
        "chunk before header": iter([store_pb2.PutRequest(chunk=bad)]),
        "empty stream": iter([]),
        "missing chunk": _messages(ckpt, chunk[:1] + chunk[2:]),
        "more bytes than declared": _messages(ckpt, [*chunk, (len(data), b"extra")]),
        "short payload": _messages(ckpt, chunk[:-1]),
        "two headers": iter(
            [*_messages(ckpt, chunk[:1]), store_pb2.PutRequest(header=store_pb2.PutHeader())]
        ),
    }
    for name, requests in cases.items():
        assert _status(client, requests) == grpc.StatusCode.INVALID_ARGUMENT, name
        _unchanged(client, before)

    corrupt = bytearray(data)
    corrupt[5] ^= 1
    flipped = [(i, bytes(corrupt[i : i + MiB])) for i in range(0, len(data), MiB)]
    assert _status(client, _messages(ckpt, flipped)) == grpc.StatusCode.INVALID_ARGUMENT
    _unchanged(client, before)

    lying = make_checkpoint(b"new", {"a_int8": 100})
    lying.tensors[0].crc32 = zlib.crc32(b"something else")
    assert (
        _status(client, _messages(lying, [(0, bytes(lying.tensors[0].data))]))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    _unchanged(client, before)


def test_put_many_refuses_what_is_not_a_put_item_before_calling(seeded: StoreClient) -> None:
    """A wrong argument is the caller's TypeError, not grpc's UNKNOWN from inside the
    request stream, and nothing is stored."""
    before = seeded.stats().records
    record = Checkpoint(key=b"loose", kind="object", tensors=[Tensor("t", "uint8", (1,), b"x")])
    with pytest.raises(TypeError, match="PutItem"):
        seeded.put_many([record])  # type: ignore[list-item]
    assert seeded.stats().records == before


def test_bad_headers_are_invalid_argument(seeded: StoreClient) -> None:
    client = seeded
    before = client.stats()
    empty_key = make_checkpoint(b"", {"a_int8": 10})
    long_key = make_checkpoint(b"k" * 65, {"a_int8": 10})
    wrong_size = make_checkpoint(b"w", {"a_bf16": 10})
    wrong_size.tensors[0].shape = (7,)
    no_kind = make_checkpoint(b"n", {"a_int8": 10}, kind="")
    bad_chain = make_checkpoint(
        b"c", {"a_int8": 10}, token_ids=[1, 2, 3], block_size=2, block_hashes=[b"h" * 32]
    )
    for ckpt in (empty_key, long_key, wrong_size, no_kind, bad_chain):
        assert _status(client, _messages(ckpt, [])) == grpc.StatusCode.INVALID_ARGUMENT
    _unchanged(client, before)


def test_if_absent_answers_already_exists(seeded: StoreClient) -> None:
    client = seeded
    before = client.stats()
    with pytest.raises(TandemError) as failure:
        client.put(make_checkpoint(b"existing", {"kv_int8": MiB}), if_absent=True)
    assert failure.value.code == grpc.StatusCode.ALREADY_EXISTS
    _unchanged(client, before)


def test_unknown_keys_and_bad_queries(seeded: StoreClient) -> None:
    client = seeded
    unknown = b"no-such-key"
    missing: tuple[Callable[[], object], ...] = (
        lambda: client.get(unknown),
        lambda: client.inspect(unknown),
        lambda: client.delete(unknown),
        lambda: client.pin(unknown),
        lambda: client.get_header(unknown),
    )
    for call in missing:
        with pytest.raises(TandemError) as failure:
            call()
        assert failure.value.code == grpc.StatusCode.NOT_FOUND
    invalid: tuple[Callable[[], object], ...] = (
        lambda: client.get(b""),
        lambda: client.list(page_size=-1),
        lambda: client.list(page_token="not-hex"),
        lambda: client.lookup(
            namespace="",
            model_id="m",
            layout=[],
            block_size=0,
            block_hashes=[b"x" * 32],
            token_count=3,
        ),
        lambda: client.lookup(
            namespace="", model_id="m", layout=[], block_size=16, block_hashes=[], token_count=0
        ),
        lambda: client.get(b"k", namespace="bad\nnamespace"),
    )
    for call in invalid:
        with pytest.raises(TandemError) as failure:
            call()
        assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert client.stats().records == 1


class _FakeContext:
    """Just enough of grpc.ServicerContext: abort raises, as grpc's does."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


def _aborted_with(exc: Exception) -> _Aborted:
    with pytest.raises(_Aborted) as aborted, status_on_error(_FakeContext(), "Get"):
        raise exc
    return aborted.value


def test_each_error_maps_to_the_status_of_its_most_specific_class(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class NoSuchLease(errors.NotFound):
        pass

    assert status_of(NoSuchLease("x")) == grpc.StatusCode.NOT_FOUND
    assert status_of(errors.Corrupt("x")) == grpc.StatusCode.DATA_LOSS
    assert status_of(errors.StorageError("x")) == grpc.StatusCode.INTERNAL
    assert status_of(KeyError("x")) is None
    defined = {
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.StoreError)
    }
    assert defined == set(errors.STATUS)

    assert (_aborted_with(errors.Overloaded("full")).code, caplog.records) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        [],
    )
    bug = _aborted_with(KeyError("oops"))
    assert (bug.code, bug.details) == (grpc.StatusCode.INTERNAL, "internal error in Get: 'oops'")
    assert caplog.records[-1].exc_info is not None  # logged with its traceback
