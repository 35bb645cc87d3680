"""The router's state and handler: the KV block index, and routing over its fleet view."""

from __future__ import annotations

from tokenyard.bus.nats import Bus
from tokenyard.facilities.tracker import RackStateTracker
from tokenyard.kv.hashing import HASH_SPEC_VERSION, prefix_block_hashes
from tokenyard.routing.policy import PolicyConfig
from tokenyard.services.router.handler import RouterHandler
from tokenyard.services.router.state import BlockIndex
from tokenyard.v1 import serving_pb2 as pb
from tokenyard.v1.facilities_pb2 import RackState, RackStateKind


def event(worker: str, kind: int, hashes: list[int]) -> pb.KVEvent:
    return pb.KVEvent(
        worker_id=worker, kind=kind, block_hashes=hashes, hash_version=HASH_SPEC_VERSION
    )


def test_overlap_counts_leading_blocks_only():
    index = BlockIndex()
    h = prefix_block_hashes(list(range(64)), 16)  # 4 blocks
    index.on_event(event("w1", pb.KVEvent.STORED, h[:3]))
    index.on_event(event("w2", pb.KVEvent.STORED, [h[0], h[2], h[3]]))  # misses block 1
    assert index.overlap(h) == {"w1": 3, "w2": 1}


def test_removed_and_cleared_events():
    index = BlockIndex()
    h = prefix_block_hashes(list(range(64)), 16)
    index.on_event(event("w1", pb.KVEvent.STORED, h))
    index.on_event(event("w2", pb.KVEvent.STORED, h))
    index.on_event(event("w1", pb.KVEvent.REMOVED, [h[1]]))
    assert index.overlap(h) == {"w1": 1, "w2": 4}
    index.on_event(event("w2", pb.KVEvent.CLEARED, []))
    assert index.overlap(h) == {"w1": 1}
    index.forget("w1")
    assert index.overlap(h) == {} and len(index) == 0


def test_foreign_hash_version_is_ignored():
    index = BlockIndex()
    index.on_event(
        pb.KVEvent(worker_id="w1", kind=pb.KVEvent.STORED, block_hashes=[1], hash_version="other")
    )
    assert index.overlap([1]) == {}


def heartbeat(worker: str, role: str, running: int = 0) -> pb.WorkerHeartbeat:
    return pb.WorkerHeartbeat(
        worker_id=worker,
        role=role,
        model="m",
        num_running=running,
        num_free_blocks=10,
        num_blocks=10,
        max_num_seqs=4,
        block_size=16,
        heartbeat_interval_ms=1000,
    )


def test_handler_routes_by_overlap_and_spreads_load():
    now = [0.0]
    handler = RouterHandler(
        Bus.__new__(Bus), PolicyConfig(disaggregation="never"), clock=lambda: now[0]
    )
    for w in ("p1", "p2"):
        handler.fleet.on_heartbeat(heartbeat(w, "prefill"), 0.0)
    prompt = list(range(256))
    hashes = prefix_block_hashes(prompt, 16)
    handler.index.on_event(event("p2", pb.KVEvent.STORED, hashes))
    route = pb.RouteRequest(
        request_id="a",
        model="m",
        num_prompt_tokens=256,
        block_hashes=hashes,
        hash_version=HASH_SPEC_VERSION,
    )
    reply = handler.route(route)
    assert reply.WhichOneof("result") == "placement"
    assert (
        reply.placement.prefill_worker_id == "p2" and reply.placement.expected_cached_tokens == 256
    )
    # Unknown prompts spread across workers: the pending count makes p2 look busier.
    other = pb.RouteRequest(request_id="b", model="m", num_prompt_tokens=20)
    assert handler.route(other).placement.prefill_worker_id == "p1"


def test_handler_no_workers_after_silence():
    now = [0.0]
    handler = RouterHandler(Bus.__new__(Bus), PolicyConfig(), clock=lambda: now[0])
    handler.fleet.on_heartbeat(heartbeat("p1", "prefill"), 0.0)
    now[0] = 3.5
    reply = handler.route(pb.RouteRequest(request_id="a", model="m", num_prompt_tokens=5))
    assert reply.WhichOneof("result") == "error"
    assert reply.error.code == pb.RouteError.NO_WORKERS


def test_handler_routes_around_a_drained_rack_in_its_fleet_view():
    racks = RackStateTracker(clock=lambda: 100.0)
    handler = RouterHandler(Bus.__new__(Bus), PolicyConfig(), racks=racks, clock=lambda: 0.0)
    for w in ("p1", "p2"):
        handler.fleet.on_heartbeat(heartbeat(w, "prefill"), 0.0)
    request = pb.RouteRequest(request_id="a", model="m", num_prompt_tokens=5)
    assert handler.route(request).placement.prefill_worker_id == "p1"  # equal: smaller id
    handler.fleet.racks.apply(
        RackState(
            rack="rack-a",
            state=RackStateKind.RACK_STATE_DRAIN,
            sent_unix_s=100.0,
            heartbeat_s=5.0,
            worker_ids=["p1"],
        )
    )
    for rid in ("b", "c"):  # even with p2's pending placements, p1 is out
        request.request_id = rid
        assert handler.route(request).placement.prefill_worker_id == "p2"
