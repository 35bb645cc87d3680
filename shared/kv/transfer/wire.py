"""The gRPC data path's ``BlockChunk`` messages, encoded and decoded by hand.

The bytes on the wire are exactly a ``tokenyard.v1.BlockChunk`` (any protobuf client can
parse them). NOTE: this exists for speed alone: building the message through the protobuf
runtime copies each chunk's payload three more times (join, field assignment,
serialization), and parsing it twice more, which on a small CPU halves the throughput of
the one transport every pair of workers has. Here the sender copies each payload once
(into the message) and the receiver reads it in place.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenyard.kv.checksum import crc32

_OFFSET = (1 << 3) | 0  # field 1, varint
_DATA = (2 << 3) | 2  # field 2, length-delimited
_CRC = (3 << 3) | 0  # field 3, varint


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
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint in a BlockChunk")


def encode_chunk(offset: int, pieces: Sequence[memoryview]) -> bytes:
    """A serialized BlockChunk whose data is the concatenation of ``pieces``."""
    crc = 0
    size = 0
    for piece in pieces:
        crc = crc32(piece, crc)
        size += len(piece)
    header = bytes([_OFFSET]) + _varint(offset) + bytes([_CRC]) + _varint(crc)
    return b"".join([header, bytes([_DATA]), _varint(size), *pieces])


def decode_chunk(message: bytes) -> tuple[int, int, memoryview]:
    """(offset, crc32, data) of a serialized BlockChunk; data is a view into ``message``."""
    buf = memoryview(message)
    offset = crc = 0
    data = buf[0:0]
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(buf, pos)
            if field == 1:
                offset = value
            elif field == 3:
                crc = value
        elif wire_type == 2:
            length, pos = _read_varint(buf, pos)
            if field == 2:
                data = buf[pos : pos + length]
            pos += length
        else:
            raise ValueError(f"unexpected wire type {wire_type} in a BlockChunk")
    if pos != len(buf):
        raise ValueError("truncated BlockChunk")
    return offset, crc, data
