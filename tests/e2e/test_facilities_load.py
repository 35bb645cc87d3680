"""Facilities under real load: the real model, and no fault injected.

Two aggregated workers with the real engine, both-1 on rack-a and both-2 on rack-b. Rack
power follows the workers' heartbeats (batch occupancy), and rack-a's cap is low enough that
a burst of requests alone takes it past its derate threshold. Then:
- the router sends new work to rack-b within one state heartbeat,
- once the burst has finished, rack-a is back to normal after the dwell time,
- no request fails (the burst's and the trickle's alike).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tokenyard.bus import subjects
from tokenyard.bus.embedded import free_port
from tokenyard.bus.nats import Bus
from tokenyard.services.facilities.service import serve
from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.services.launch.stack import LocalStack, StackConfig
from tokenyard.v1 import serving_pb2 as pb
from tokenyard.v1.facilities_pb2 import RackState, RackStateKind

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HEARTBEAT_S = 1.0
DWELL_S = 3.0
BURST = 12  # concurrent requests: about half land on rack-a
HOT = (RackStateKind.RACK_STATE_DERATE, RackStateKind.RACK_STATE_DRAIN)


def inventory(path: Path) -> Path:
    """rack-a: 0.3 kW idle under a 1 kW cap, so 4 running sequences of 32 (8 x 700 W x 4/32
    = 0.7 kW) reach 100%; rack-b has room to spare."""
    loop = {"supply_limit_c": 32, "return_limit_c": 45, "min_flow_lpm": 15,
            "nominal_supply_c": 25, "nominal_flow_lpm": 30}  # fmt: skip

    def rack(name: str, cap: float, worker: str) -> dict:
        node = {"name": f"node-{name}", "gpus": 8, "gpu_tdp_w": 700, "workers": [worker]}
        return {"name": name, "loop": f"loop-{name}", "cooling": "liquid",
                "power_cap_kw": cap, "idle_power_kw": 0.3, "nodes": [node]}  # fmt: skip

    doc = {
        "site": "load-test",
        "coolant_loops": [{"name": "loop-rack-a", **loop}, {"name": "loop-rack-b", **loop}],
        "racks": [rack("rack-a", 1.0, "both-1"), rack("rack-b", 8.0, "both-2")],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    config = StackConfig(port=free_port(), aggregated=True, kvcache=False, facilities=False,
                         telemetry=False)  # fmt: skip
    with LocalStack(config) as s:
        s.add_worker("both")
        s.wait_ready(timeout=300)
        yield s


class Observer:
    def __init__(self) -> None:
        self.jobs: list[tuple[float, str]] = []
        self.states: list[tuple[float, RackState]] = []

    async def on_job(self, _job: pb.PrefillJob, msg: object) -> None:
        self.jobs.append((time.monotonic(), msg.subject.rsplit(".", 1)[-1]))  # type: ignore[attr-defined]

    async def on_state(self, state: RackState, _msg: object) -> None:
        self.states.append((time.monotonic(), state))

    async def wait(self, rack: str, kinds: tuple, timeout: float, after: float = 0.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, s in self.states:
                if at >= after and s.rack == rack and s.state in kinds:
                    return at, s
            await asyncio.sleep(0.05)
        seen = [(round(at, 1), s.rack, s.state, s.reason) for at, s in self.states[-6:]]
        raise AssertionError(f"{rack} never reached {kinds} in {timeout} s; last: {seen}")

    def workers_between(self, start: float, end: float) -> list[str]:
        return [w for at, w in self.jobs if start <= at <= end]


async def complete(client: httpx.AsyncClient, model: str, max_tokens: int, i: int) -> int:
    body = {"model": model, "prompt": f"Tell me about rack number {i}:", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    return (await client.post("/v1/completions", json=body)).status_code


async def trickle(client, model: str, stop: asyncio.Event, statuses: list[int]) -> None:
    i = 0
    while not stop.is_set():
        statuses.append(await complete(client, model, 2, 1000 + i))
        i += 1
        await asyncio.sleep(0.3)


async def test_load_alone_derates_a_rack_and_new_work_moves_away(
    stack: LocalStack, tmp_path: Path
) -> None:
    settings = FacilitiesSettings(
        nats_url=stack.nats_url, data_dir=tmp_path, inventory_path=inventory(tmp_path / "inv.yaml"),
        admin_token="unused", port=free_port(), grpc_port=free_port(), tick_s=0.25, dwell_s=DWELL_S,
        state_heartbeat_s=HEARTBEAT_S, sim_time_constant_s=0.0,
    )  # fmt: skip
    obs, stop_service, stop_trickle = Observer(), asyncio.Event(), asyncio.Event()
    bus = await Bus.connect(stack.nats_url, name="facilities-load-e2e")
    service = asyncio.create_task(serve(settings, stop_service))
    statuses: list[int] = []
    try:
        await bus.subscribe(subjects.prefill_worker_jobs("*"), pb.PrefillJob, obs.on_job)
        await bus.subscribe(subjects.FACILITIES_STATE_ALL, RackState, obs.on_state)
        await obs.wait("rack-a", (RackStateKind.RACK_STATE_NORMAL,), timeout=30)
        await asyncio.sleep(HEARTBEAT_S * 1.5)  # the router has heard both racks
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=600,
                                     trust_env=False) as client:  # fmt: skip
            burst_at = time.monotonic()
            burst = [
                asyncio.create_task(complete(client, stack.model_id, 48, i)) for i in range(BURST)
            ]
            hot_at, hot = await obs.wait("rack-a", HOT, timeout=120, after=burst_at)
            assert "power" in hot.reason, hot.reason  # load alone: no fault was injected
            assert set(obs.workers_between(burst_at, hot_at)) == {"both-1", "both-2"}
            load = asyncio.create_task(trickle(client, stack.model_id, stop_trickle, statuses))
            statuses.extend(await asyncio.gather(*burst))
            burst_done = time.monotonic()
            normal_at, _ = await obs.wait(
                "rack-a", (RackStateKind.RACK_STATE_NORMAL,), timeout=120, after=hot_at
            )
            stop_trickle.set()
            await load
        moved = obs.workers_between(hot_at + HEARTBEAT_S, min(burst_done, normal_at))
        assert moved and set(moved) == {"both-2"}, f"new work while rack-a was hot: {moved}"
        assert normal_at - hot_at >= DWELL_S
        assert statuses and all(s == 200 for s in statuses), statuses
        print(
            f"\nrack-a {RackStateKind.Name(hot.state)} {hot_at - burst_at:.1f} s into the burst"
            f" ({hot.reason}); {len(moved)} requests to rack-b meanwhile; normal again"
            f" {normal_at - hot_at:.1f} s later; {len(statuses)} requests, all 200"
        )
    finally:
        stop_trickle.set()
        stop_service.set()
        await asyncio.wait_for(service, 10)
        await bus.close()
