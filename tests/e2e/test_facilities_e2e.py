"""Facilities on the whole stack: two workers on two racks, a pump failure on rack A.

New requests all go to rack B within one state heartbeat, no request fails, and rack A is
back to normal (and used again) once the fault is cleared and the dwell time has passed.
Workers run the engine's test double, so the placement logic is what is measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tokenyard.bus import subjects
from tokenyard.bus.embedded import free_port
from tokenyard.bus.nats import Bus
from tokenyard.services.facilities.service import serve
from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.services.launch.stack import LocalStack, StackConfig
from tokenyard.v1 import serving_pb2 as pb
from tokenyard.v1.facilities_pb2 import RackState, RackStateKind

pytestmark = pytest.mark.slow

TOKEN = "e2e-admin"
HEARTBEAT_S = 1.0
DWELL_S = 3.0


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    # Aggregated workers (role both): both-1 is on rack-a, both-2 on rack-b (example inventory).
    config = StackConfig(
        port=free_port(), aggregated=True, engine="fake", kvcache=False, facilities=False
    )
    with LocalStack(config) as s:
        s.add_worker("both")
        s.wait_ready(timeout=120)
        yield s


class Observer:
    """Which worker each new request was placed on (prefill jobs), and every RackState."""

    def __init__(self) -> None:
        self.jobs: list[tuple[float, str]] = []
        self.states: list[tuple[float, RackState]] = []

    async def on_job(self, job: pb.PrefillJob, msg: object) -> None:
        self.jobs.append((time.monotonic(), msg.subject.rsplit(".", 1)[-1]))  # type: ignore[attr-defined]

    async def on_state(self, state: RackState, _msg: object) -> None:
        self.states.append((time.monotonic(), state))

    async def wait_state(self, rack: str, kind: RackStateKind.ValueType, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, s in self.states:
                if s.rack == rack and s.state == kind:
                    return at
            await asyncio.sleep(0.05)
        raise AssertionError(f"{rack} never reached {RackStateKind.Name(kind)}")

    def workers_between(self, start: float, end: float) -> list[str]:
        return [w for at, w in self.jobs if start <= at <= end]


async def drive(url: str, stop: asyncio.Event, statuses: list[int], concurrency: int = 3) -> None:
    async def one_client(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            r = await client.post(
                "/v1/completions",
                json={"model": "fake-model", "prompt": "hello racks", "max_tokens": 4},
            )
            statuses.append(r.status_code)
            await asyncio.sleep(0.05)

    async with (
        httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as client,
        asyncio.TaskGroup() as tg,
    ):
        for _ in range(concurrency):
            tg.create_task(one_client(client))


@pytest.fixture
def settings(stack: LocalStack, tmp_path: Path, example_inventory: Path) -> FacilitiesSettings:
    """The facilities service on the stack's NATS, fast ticks, the example inventory."""
    return FacilitiesSettings(
        nats_url=stack.nats_url,
        data_dir=tmp_path,
        inventory_path=example_inventory,
        admin_token=TOKEN,
        port=free_port(),
        grpc_port=free_port(),  # not the default 50075: another server may hold it
        tick_s=0.25,
        dwell_s=DWELL_S,
        state_heartbeat_s=HEARTBEAT_S,
        sim_time_constant_s=0.0,
    )


async def test_pump_failure_moves_new_requests_to_the_other_rack(
    stack: LocalStack, settings: FacilitiesSettings
) -> None:
    obs = Observer()
    bus = await Bus.connect(stack.nats_url, name="facilities-e2e")
    stop_service, stop_load = asyncio.Event(), asyncio.Event()
    statuses: list[int] = []
    service = asyncio.create_task(serve(settings, stop_service))
    try:
        await bus.subscribe(subjects.prefill_worker_jobs("*"), pb.PrefillJob, obs.on_job)
        await bus.subscribe(subjects.FACILITIES_STATE_ALL, RackState, obs.on_state)
        await obs.wait_state("rack-a", RackStateKind.RACK_STATE_NORMAL, timeout=30)
        await asyncio.sleep(HEARTBEAT_S * 1.5)  # the router has heard both racks
        load = asyncio.create_task(drive(stack.gateway_url, stop_load, statuses))
        admin = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{settings.port}",
            headers={"Authorization": f"Bearer {TOKEN}"},
            trust_env=False,
        )
        await asyncio.sleep(3)
        t0 = time.monotonic()
        assert set(obs.workers_between(0, t0)) == {"both-1", "both-2"}, (
            "both racks serve before the fault"
        )

        r = await admin.post("/v1/admin/racks/rack-a/faults", json={"kind": "pump_failure"})
        assert r.status_code == 200
        drained_at = await obs.wait_state("rack-a", RackStateKind.RACK_STATE_DRAIN, timeout=5)
        await asyncio.sleep(HEARTBEAT_S + 3)
        after = obs.workers_between(drained_at + HEARTBEAT_S, time.monotonic())
        assert after and set(after) == {"both-2"}, (
            f"new requests after the drain went to {sorted(set(after))}"
        )

        cleared = time.monotonic()
        await admin.delete("/v1/admin/racks/rack-a/faults")
        obs.states.clear()
        normal_at = await obs.wait_state(
            "rack-a", RackStateKind.RACK_STATE_NORMAL, timeout=DWELL_S + 10
        )
        assert normal_at - cleared >= DWELL_S
        await asyncio.sleep(HEARTBEAT_S + 3)
        assert "both-1" in obs.workers_between(normal_at, time.monotonic()), "rack A is used again"

        stop_load.set()
        await load
        await admin.aclose()
        assert statuses and all(s == 200 for s in statuses), (
            f"failed requests: {[s for s in statuses if s != 200]}"
        )
        late = [
            at - drained_at for at, w in obs.jobs if w == "both-1" and drained_at <= at < cleared
        ]
        print(
            f"\n{len(statuses)} requests, all 200; last placement on rack A {max(late, default=0):.2f} s"
            f" after its drain; rack A normal {normal_at - cleared:.1f} s after the clear (dwell {DWELL_S} s)"
        )
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{settings.port}", trust_env=False
        ) as api:
            events = (await api.get("/v1/events", params={"rack": "rack-a"})).json()["events"]
        assert [(e["from_state"], e["to_state"]) for e in events] == [
            ("normal", "drain"),
            ("drain", "normal"),
        ]
    finally:
        stop_load.set()
        stop_service.set()
        await asyncio.wait_for(service, 10)
        await bus.close()


async def test_every_rack_drained_answers_503_with_retry_after(
    stack: LocalStack, settings: FacilitiesSettings
) -> None:
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, stop))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        async with (
            httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{settings.port}", headers=headers, trust_env=False
            ) as admin,
            httpx.AsyncClient(base_url=stack.gateway_url, timeout=30, trust_env=False) as gateway,
        ):
            for _ in range(100):
                with contextlib.suppress(httpx.TransportError):
                    if (await admin.get("/health")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            for rack in ("rack-a", "rack-b"):
                assert (
                    await admin.post(
                        f"/v1/admin/racks/{rack}/faults", json={"kind": "pump_failure"}
                    )
                ).status_code == 200
            await asyncio.sleep(HEARTBEAT_S + 1)
            started = time.monotonic()
            r = await gateway.post(
                "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2}
            )
            assert time.monotonic() - started < 5, "a drained fleet answers at once, never hangs"
            assert r.status_code == 503
            assert int(r.headers["retry-after"]) > 0
            assert "drain" in r.json()["error"]["message"]
            for rack in ("rack-a", "rack-b"):
                await admin.delete(f"/v1/admin/racks/{rack}/faults")
    finally:
        stop.set()
        await asyncio.wait_for(service, 10)
