"""Hand-encoded payload chunks for the store's bulk paths (Put requests, Get responses).

protobuf's Python API copies a bytes field when it is set, again when the message is
serialized, and once more when it is read back; at GB/s those copies cost more than the
network. These helpers write and read the very same wire format (PutRequest.chunk and
GetResponse.chunk are both field 2, a Chunk of offset = 1 and data = 2), copying the data
once, and are checked against protobuf's own encoding in tests/test_wire.py. Everything
that is not a bare chunk (headers, other fields) still goes through protobuf.
"""

from __future__ import annotations

from typing import Any

CHUNK_FIELD = 2  # PutRequest.chunk and GetResponse.chunk
_LEN = 2  # wire type: length-delimited
_VARINT = 0


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def encode_chunk(offset: int, data: Any) -> bytes:
    """A PutRequest / GetResponse holding one Chunk, as wire bytes (one copy of data)."""
    size = memoryview(data).nbytes
    inner = b"\x08" + _varint(offset) + b"\x12" + _varint(size)
    return b"".join((bytes([CHUNK_FIELD << 3 | _LEN]), _varint(len(inner) + size), inner, data))


def decode_chunk(raw: bytes) -> tuple[int, memoryview] | None:
    """(offset, data view into raw) if raw is a message holding just a chunk, else None."""
    buf = memoryview(raw)
    pos = 0
    found: tuple[int, memoryview] | None = None
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire != _LEN or field != CHUNK_FIELD:
            return None  # a header or something else: let protobuf parse it
        length, pos = _read_varint(buf, pos)
        found = _decode_inner(buf[pos : pos + length])
        pos += length
    return found


def _decode_inner(buf: memoryview) -> tuple[int, memoryview]:
    offset, data, pos = 0, buf[0:0], 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            value, pos = _read_varint(buf, pos)
            if field == 1:
                offset = value
        elif wire == _LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("truncated chunk")
            if field == 2:
                data = buf[pos : pos + length]
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return offset, data
