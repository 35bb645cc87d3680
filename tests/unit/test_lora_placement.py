"""Whether a busy LoRA adapter is loaded on another worker, on scripted worker tables."""

from __future__ import annotations

from tokenyard.facilities.tracker import WorkerThrottle
from tokenyard.fleet import WorkerView
from tokenyard.routing.lora_placement import LoadPlan, load_target
from tokenyard.routing.policy import PolicyConfig, RouteInput, choose
from tokenyard.v1 import serving_pb2 as pb

NOW = 100.0
MODEL = "m"
PATH = "/adapters/sql"
SQL = RouteInput("r1", MODEL, 100, {}, lora="sql")


def worker(
    worker_id: str,
    *,
    running: int = 0,
    waiting: int = 0,
    holds: bool = False,
    room: int = 4,
    role: str = "both",
    model: str = MODEL,
) -> WorkerView:
    hb = pb.WorkerHeartbeat(
        worker_id=worker_id,
        role=role,
        model=model,
        num_running=running,
        num_waiting=waiting,
        num_free_blocks=100,
        num_blocks=100,
        max_num_seqs=8,
        lora_room=room,
    )
    if holds:
        hb.lora_adapters.append("sql")
        hb.lora_paths["sql"] = PATH
    return WorkerView(hb, last_seen=NOW)


def table(*workers: WorkerView) -> dict[str, WorkerView]:
    return {w.worker_id: w for w in workers}


def test_a_holder_with_a_free_slot_keeps_the_adapter_to_itself():
    workers = table(worker("h", running=7, holds=True), worker("idle"))
    assert load_target(workers, SQL, NOW) is None
    out = choose(workers, SQL, NOW)  # and the request goes to the holder, not the idle one
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "h"


def test_every_holder_full_loads_it_on_the_least_busy_worker_with_room():
    workers = table(
        worker("h1", running=8, holds=True),
        worker("h2", running=8, waiting=3, holds=True),
        worker("a", running=5),
        worker("b", running=2),
        worker("full", running=0, room=0),  # idle, but no room for one more adapter
    )
    assert load_target(workers, SQL, NOW) == LoadPlan("b", "sql", PATH)


def test_the_threshold_is_a_setting():
    workers = table(worker("h", running=4, holds=True), worker("idle"))
    assert load_target(workers, SQL, NOW) is None  # half full: under the default 1.0
    half = PolicyConfig(lora_load_busy=0.5)
    assert load_target(workers, SQL, NOW, config=half) == LoadPlan("idle", "sql", PATH)


def test_no_load_when_every_other_worker_is_as_busy():
    workers = table(worker("h", running=8, holds=True), worker("other", running=9))
    assert load_target(workers, SQL, NOW) is None


def test_no_load_for_the_base_model_or_an_adapter_held_nowhere():
    workers = table(worker("h", running=8, holds=True), worker("idle"))
    assert load_target(workers, RouteInput("r1", MODEL, 100, {}), NOW) is None
    nowhere = RouteInput("r1", MODEL, 100, {}, lora="poet")
    assert load_target(workers, nowhere, NOW) is None


def test_only_workers_of_the_model_that_take_prompts_and_are_open_load_it():
    busy = worker("h", running=8, holds=True)
    other_model = worker("x", model="other")
    decode_only = worker("d", role="decode")
    drained_rack = worker("r")
    dead = WorkerView(worker("gone").heartbeat, last_seen=NOW - 60)
    workers = table(busy, other_model, decode_only, drained_rack, dead)
    racks = {"r": WorkerThrottle(state="drain")}
    assert load_target(workers, SQL, NOW, facilities=racks) is None
    assert load_target(workers, SQL, NOW) == LoadPlan("r", "sql", PATH)


def test_once_loaded_the_new_holder_takes_the_next_request():
    workers = table(worker("h", running=8, holds=True), worker("idle", holds=True))
    out = choose(workers, SQL, NOW)
    assert isinstance(out, pb.Placement) and out.prefill_worker_id == "idle"
    assert load_target(workers, SQL, NOW) is None  # a holder has room now
