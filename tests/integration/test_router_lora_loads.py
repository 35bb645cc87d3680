"""The router loads a busy LoRA adapter on a worker with room, on a real nats-server: route
requests and the load go over NATS (ty.router.route, ty.lora.<worker>). The worker's side
of ty.lora.<worker> is a stand-in that records the request and answers as
services/worker/lora.py does (the real one runs in tests/e2e/test_lora_stack.py)."""

from __future__ import annotations

import asyncio

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.routing.policy import PolicyConfig
from tokenyard.services.router.handler import RouterHandler
from tokenyard.v1 import serving_pb2 as pb

MODEL = "m"
PATH = "/adapters/sql"


def beat(worker_id: str, *, running: int, holds: bool) -> pb.WorkerHeartbeat:
    hb = pb.WorkerHeartbeat(
        worker_id=worker_id,
        role="both",
        model=MODEL,
        num_running=running,
        num_free_blocks=100,
        num_blocks=100,
        max_num_seqs=4,
        heartbeat_interval_ms=60_000,  # no beat again during the test
        lora_room=4,
    )
    if holds:
        hb.lora_adapters.append("sql")
        hb.lora_paths["sql"] = PATH
    return hb


async def route(bus: Bus, request_id: str) -> pb.Placement:
    req = pb.RouteRequest(request_id=request_id, model=MODEL, num_prompt_tokens=20, lora="sql")
    reply = await bus.request(subjects.ROUTER_ROUTE, req, pb.RouteReply, timeout=5)
    assert reply.WhichOneof("result") == "placement", reply
    return reply.placement


async def test_a_busy_adapter_is_loaded_where_there_is_room_and_placed_there(bus: Bus):
    handler = RouterHandler(bus, PolicyConfig(disaggregation="never"))
    await bus.subscribe(subjects.ROUTER_ROUTE, pb.RouteRequest, handler.on_route)
    asked: list[pb.LoRAAdapterRequest] = []

    async def on_load(req: pb.LoRAAdapterRequest, msg) -> None:
        asked.append(req)
        ok = pb.LoRAAdapterReply(ok=True, status=200, message=f"loaded {req.lora_name!r}")
        await bus.reply(msg, ok)

    await bus.subscribe(subjects.lora("idle"), pb.LoRAAdapterRequest, on_load)
    await bus.subscribe(subjects.lora("holder"), pb.LoRAAdapterRequest, on_load)
    await handler.on_heartbeat(beat("holder", running=2, holds=True), None)  # type: ignore[arg-type]
    await handler.on_heartbeat(beat("idle", running=0, holds=False), None)  # type: ignore[arg-type]

    # The holder has free slots: it takes the request, nothing is loaded.
    assert (await route(bus, "r1")).prefill_worker_id == "holder"
    await asyncio.sleep(0.2)
    assert asked == []

    # With r2 every slot of the holder is taken (2 running + 2 placed): r2 still goes to the
    # holder, and the idle worker is asked to load the adapter from the holder's path.
    assert (await route(bus, "r2")).prefill_worker_id == "holder"
    for _ in range(50):
        if handler.lora_loads.loaded:
            break
        await asyncio.sleep(0.1)
    assert [(a.action, a.lora_name, a.lora_path) for a in asked] == [
        (pb.LoRAAdapterRequest.LOAD, "sql", PATH)
    ]
    # Once loaded there, the next requests on the adapter go to the idle worker, and nothing
    # is loaded again.
    assert (await route(bus, "r3")).prefill_worker_id == "idle"
    assert (await route(bus, "r4")).prefill_worker_id == "idle"
    assert len(asked) == 1
    await handler.close()
