"""The hand-encoded chunk format is protobuf's own."""

from __future__ import annotations

import pytest

from store_service.wire import MALFORMED, parse_put_request
from tandem_wire.chunks import decode_chunk, encode_chunk
from tandem_wire.pb import store_pb2, tensors_pb2


@pytest.mark.parametrize(
    "offset,data",
    [(0, b""), (0, b"abc"), (300, b"\x00" * 200), (2**40 + 5, bytes(range(256)) * 600)],
)
def test_encoding_matches_protobuf(offset: int, data: bytes) -> None:
    ours = encode_chunk(offset, memoryview(data))
    for cls in (store_pb2.PutRequest, store_pb2.GetResponse):
        parsed = cls.FromString(ours)
        assert (parsed.chunk.offset, parsed.chunk.data) == (offset, data)
        theirs = cls(chunk=tensors_pb2.Chunk(offset=offset, data=data)).SerializeToString()
        decoded = decode_chunk(theirs)
        assert decoded is not None
        got_offset, got_data = decoded
        assert (got_offset, bytes(got_data)) == (offset, data)


def test_headers_and_garbage_fall_back_to_protobuf_or_are_flagged() -> None:
    header = store_pb2.PutRequest(header=store_pb2.PutHeader(if_absent=True)).SerializeToString()
    assert decode_chunk(header) is None
    assert parse_put_request(header).header.if_absent
    assert parse_put_request(b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff") is MALFORMED
    assert parse_put_request(b"\x12\x05\x12\x09abc") is MALFORMED
