"""Pure pieces of the KV transfer layer: negotiation, holds, block runs."""

from __future__ import annotations

import pytest

from tokenyard.kv.transfer.common import block_runs
from tokenyard.kv.transfer.holds import HoldTable
from tokenyard.kv.transfer.negotiate import TRANSPORTS, Peer, candidates
from tokenyard.kv.transfer.settings import KVTransferSettings

ALL = frozenset(TRANSPORTS)


def peer(allowed=ALL, host="h1", proc="p1", shm=False, mc=False) -> Peer:
    return Peer(frozenset(allowed), host, proc, has_shm=shm, has_mooncake=mc)


def test_best_transport_first_and_grpc_always_last():
    me = peer(mc=True)
    them = peer(shm=True, mc=True)
    assert candidates(me, them, server_in_process=True) == ["inproc", "shm", "mooncake", "grpc"]


def test_other_process_same_host_without_shared_pool():
    assert candidates(peer(), peer(proc="p2"), server_in_process=False) == ["grpc"]


def test_other_host_never_gets_shm_or_inproc():
    them = peer(host="h2", proc="p2", shm=True, mc=True)
    assert candidates(peer(mc=True), them, server_in_process=False) == ["mooncake", "grpc"]


def test_only_what_both_sides_allow():
    them = peer(allowed={"shm", "mooncake"}, proc="p2", shm=True, mc=True)
    me = peer(allowed={"mooncake", "grpc"}, mc=True)
    assert candidates(me, them, server_in_process=False) == ["mooncake"]
    assert candidates(peer(allowed={"grpc"}), them, server_in_process=False) == []


def test_settings_reject_unknown_transports():
    with pytest.raises(ValueError, match="unknown KV transports"):
        KVTransferSettings(allowed=["grpc", "carrier-pigeon"])


def test_block_runs_coalesce_when_both_sides_are_consecutive():
    assert block_runs([3, 4, 5, 9, 1], [0, 1, 2, 3, 4]) == [(3, 0, 3), (9, 3, 1), (1, 4, 1)]
    assert block_runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]
    with pytest.raises(ValueError):
        block_runs([1], [1, 2])


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_holds_expire_unless_touched_and_end_once():
    clock = Clock()
    holds = HoldTable(10.0, clock)
    holds.offer("a", [1, 2])
    holds.offer("b", [3])
    with pytest.raises(ValueError, match="already"):
        holds.offer("a", [4])
    clock.now += 8
    assert holds.check("a", [2]) is None  # touching extends a's deadline
    assert "not offered" in holds.check("a", [3])
    clock.now += 3
    assert holds.expired() == ["b"]
    assert holds.end("a") is True
    assert holds.end("a") is False
    assert "released or expired" in holds.check("a", [1])
    assert len(holds) == 0


def test_hand_encoded_chunks_are_plain_block_chunk_messages():
    import zlib

    from tokenyard.kv.transfer.wire import decode_chunk, encode_chunk
    from tokenyard.v1 import kv_pb2

    pieces = [memoryview(b"abc" * 100), memoryview(b"\x00\xff" * 70000)]
    data = b"".join(pieces)
    message = encode_chunk(1 << 40, pieces)
    parsed = kv_pb2.BlockChunk.FromString(message)
    assert (parsed.offset, parsed.data, parsed.crc32) == (1 << 40, data, zlib.crc32(data))

    standard = kv_pb2.BlockChunk(offset=300, data=data, crc32=7).SerializeToString()
    offset, crc, view = decode_chunk(standard)
    assert (offset, crc, bytes(view)) == (300, 7, data)
    assert decode_chunk(kv_pb2.BlockChunk().SerializeToString())[2].nbytes == 0
    with pytest.raises((ValueError, IndexError)):
        decode_chunk(message[:-5])
