"""The router's KV event sequencing: in-order events apply, a gap or an unknown epoch asks
for a dump, and the dump plus the events kept aside rebuild the worker's blocks exactly."""

from __future__ import annotations

from tokenyard.kv.hashing import HASH_SPEC_VERSION
from tokenyard.services.router.kv_sync import MAX_BUFFERED, KVSync
from tokenyard.services.router.state import BlockIndex
from tokenyard.v1 import serving_pb2 as pb

STORED, REMOVED, CLEARED = pb.KVEvent.STORED, pb.KVEvent.REMOVED, pb.KVEvent.CLEARED


def ev(seq: int, kind: int, hashes: list[int], epoch: str = "e1", worker: str = "w") -> pb.KVEvent:
    return pb.KVEvent(
        worker_id=worker,
        kind=kind,
        block_hashes=hashes,
        hash_version=HASH_SPEC_VERSION,
        seq=seq,
        epoch=epoch,
    )


def dump(seq: int, hashes: list[int], epoch: str = "e1", worker: str = "w") -> pb.KVDump:
    return pb.KVDump(
        worker_id=worker, epoch=epoch, seq=seq, block_hashes=hashes, hash_version=HASH_SPEC_VERSION
    )


def beat(seq: int, epoch: str = "e1", worker: str = "w") -> pb.WorkerHeartbeat:
    return pb.WorkerHeartbeat(worker_id=worker, kv_epoch=epoch, kv_seq=seq)


def fresh() -> tuple[KVSync, BlockIndex]:
    index = BlockIndex()
    sync = KVSync(index)
    assert not sync.on_event(ev(1, CLEARED, []))  # a new worker's first event: no resync
    return sync, index


def test_events_in_order_apply_and_old_ones_are_dropped():
    sync, index = fresh()
    assert not sync.on_event(ev(2, STORED, [10, 11]))
    assert not sync.on_event(ev(3, REMOVED, [10]))
    assert not sync.on_event(ev(2, STORED, [10, 11]))  # a duplicate: old news
    assert index.blocks_of("w") == {11}
    assert sync.streams["w"].seq == 3


def test_a_gap_asks_for_a_dump_and_the_dump_plus_later_events_rebuild_the_blocks():
    sync, index = fresh()
    sync.on_event(ev(2, STORED, [1, 2]))
    # 3 (STORED 3) and 4 (REMOVED 1) are lost; 5 arrives
    assert sync.on_event(ev(5, STORED, [5]))
    assert sync.streams["w"].resyncing
    assert not sync.on_event(ev(6, REMOVED, [2]))  # kept aside, no second request
    assert index.blocks_of("w") == {1, 2}  # unchanged until the dump
    # The worker's dump as of event 5 (its engine had 2, 3, 5 then); 6 follows it.
    assert not sync.on_dump(dump(5, [2, 3, 5]))
    assert index.blocks_of("w") == {3, 5}
    assert index.overlap([3]) == {"w": 1}
    assert not sync.streams["w"].resyncing and sync.streams["w"].seq == 6
    assert not sync.on_event(ev(7, STORED, [7]))  # back in step
    assert index.blocks_of("w") == {3, 5, 7}


def test_a_dump_taken_after_some_kept_events_ends_in_the_same_state():
    # The dump already includes event 6 (taken after it), and 6 is applied again on top.
    sync, index = fresh()
    assert sync.on_event(ev(4, STORED, [4]))
    sync.on_event(ev(5, STORED, [5]))
    sync.on_event(ev(6, REMOVED, [4]))
    assert not sync.on_dump(dump(4, [4, 5]))  # seq read before the engine answered
    assert index.blocks_of("w") == {5}


def test_a_gap_in_the_events_kept_aside_asks_again():
    sync, index = fresh()
    assert sync.on_event(ev(5, STORED, [5]))
    sync.on_event(ev(8, STORED, [8]))  # 6 and 7 lost too
    assert sync.on_dump(dump(5, [5]))
    assert sync.streams["w"].resyncing
    assert not sync.on_dump(dump(8, [5, 8]))
    assert index.blocks_of("w") == {5, 8}


def test_a_restarted_worker_is_a_new_stream():
    sync, index = fresh()
    sync.on_event(ev(2, STORED, [1, 2]))
    # Its new process starts at 1: the old blocks are gone, nothing to ask.
    assert not sync.on_event(ev(1, CLEARED, [], epoch="e2"))
    assert index.blocks_of("w") == set()
    assert not sync.on_event(ev(2, STORED, [9], epoch="e2"))
    assert index.blocks_of("w") == {9}
    # A new epoch seen mid-stream (its first events lost): ask.
    assert sync.on_event(ev(7, STORED, [3], epoch="e3"))
    assert not sync.on_dump(dump(7, [3, 9], epoch="e3"))
    assert index.blocks_of("w") == {3, 9}


def test_a_restarted_router_resyncs_on_the_first_heartbeat():
    index = BlockIndex()
    sync = KVSync(index)
    assert sync.on_heartbeat(beat(40))  # an epoch it does not follow
    assert not sync.on_heartbeat(beat(41))  # one request at a time
    assert not sync.on_event(ev(41, STORED, [41]))  # kept aside
    assert not sync.on_dump(dump(40, [1, 2, 40]))
    assert index.blocks_of("w") == {1, 2, 40, 41}


def test_an_event_a_heartbeat_announced_still_missing_at_the_next_is_lost():
    sync, _ = fresh()
    assert not sync.on_heartbeat(beat(1))
    assert not sync.on_heartbeat(beat(2))  # event 2 may still be on its way
    assert not sync.on_event(ev(2, STORED, [2]))
    # A busy worker: each heartbeat is ahead, and what it announced arrives before the next.
    for seq in range(3, 8):
        assert not sync.on_heartbeat(beat(seq))
        assert not sync.on_event(ev(seq, STORED, [seq]))
    assert not sync.on_heartbeat(beat(8))  # event 8 published, then lost
    assert sync.on_heartbeat(beat(8))  # still missing one interval later: ask
    assert sync.streams["w"].resyncing


def test_a_failed_resync_asks_again_on_the_next_heartbeat_and_old_workers_are_ignored():
    sync, index = fresh()
    assert sync.on_event(ev(3, STORED, [3]))
    sync.resync_failed("w")
    assert sync.on_heartbeat(beat(3))
    assert not sync.on_heartbeat(pb.WorkerHeartbeat(worker_id="old"))  # numbers no events
    assert "old" not in sync.streams


def test_garbage_events_without_a_number_change_nothing():
    sync = KVSync(BlockIndex())
    assert not sync.on_event(pb.KVEvent(worker_id="x", kind=STORED, block_hashes=[1]))
    assert sync.index.blocks_of("x") == set()


def test_forget_drops_the_stream_and_the_blocks():
    sync, index = fresh()
    sync.on_event(ev(2, STORED, [1]))
    sync.forget("w")
    assert index.blocks_of("w") == set() and "w" not in sync.streams


def test_events_kept_aside_are_bounded():
    sync, index = fresh()
    assert sync.on_event(ev(3, STORED, [3]))
    for seq in range(4, 4 + MAX_BUFFERED + 10):
        sync.on_event(ev(seq, STORED, [seq]))
    assert len(sync.streams["w"].buffered) == MAX_BUFFERED
    # The oldest were dropped, so the replay after the dump finds a gap and asks again.
    assert sync.on_dump(dump(3, [3]))
