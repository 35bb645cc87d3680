"""The facilities service against a real nats-server: faults in, states out, history stored."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from tokenyard.bus import subjects
from tokenyard.bus.embedded import free_port
from tokenyard.bus.nats import Bus
from tokenyard.facilities.tracker import RackStateTracker
from tokenyard.services.facilities.service import serve
from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.v1 import externalscaler_pb2 as epb
from tokenyard.v1 import externalscaler_pb2_grpc
from tokenyard.v1.facilities_pb2 import FacilityReading, RackState, RackStateKind
from tokenyard.v1.serving_pb2 import WorkerHeartbeat

TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
DWELL_S = 1.5


@pytest.fixture
def settings(tmp_path: Path, nats_url: str, example_inventory: Path) -> FacilitiesSettings:
    """The service on the module's NATS with the example inventory and fast clocks."""
    return FacilitiesSettings(
        nats_url=nats_url,
        data_dir=tmp_path,
        inventory_path=example_inventory,
        admin_token=TOKEN,
        port=free_port(),
        grpc_port=free_port(),  # not the default 50075: a test NATS may hold it
        tick_s=0.2,
        dwell_s=DWELL_S,
        stale_after_s=1.0,
        state_heartbeat_s=0.5,
        sim_time_constant_s=0.0,
    )


@asynccontextmanager
async def running(settings: FacilitiesSettings) -> AsyncIterator[httpx.AsyncClient]:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stop))
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{settings.port}", timeout=5.0
    ) as client:
        try:
            deadline = time.monotonic() + 30
            while True:
                if task.done():
                    task.result()  # raises the start-up error
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/health")).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError("facilities service did not start")
                await asyncio.sleep(0.05)
            yield client
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)


class StateLog:
    """Every RackState seen on ty.facilities.state.*, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, RackState]] = []

    async def on_state(self, msg: RackState, _raw: object) -> None:
        self.seen.append((time.monotonic(), msg))

    async def wait_for(
        self, rack: str, kind: RackStateKind.ValueType, timeout: float = 10.0
    ) -> tuple[float, RackState]:
        deadline = time.monotonic() + timeout
        start = len(self.seen)
        while time.monotonic() < deadline:
            for at, msg in self.seen[start:]:
                if msg.rack == rack and msg.state == kind:
                    return at, msg
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {RackStateKind.Name(kind)} for {rack} within {timeout} s")


async def watch(bus: Bus) -> tuple[StateLog, RackStateTracker]:
    log, tracker = StateLog(), RackStateTracker()
    await bus.subscribe(subjects.FACILITIES_STATE_ALL, RackState, log.on_state)
    await tracker.start(bus)
    return log, tracker


async def test_pump_failure_drains_the_rack_then_clears_after_dwell(
    settings: FacilitiesSettings, bus: Bus
) -> None:
    log, tracker = await watch(bus)
    async with running(settings) as api:
        await log.wait_for("rack-a", RackStateKind.RACK_STATE_NORMAL)  # the state heartbeat
        r = await api.post(
            "/v1/admin/racks/rack-a/faults", json={"kind": "pump_failure"}, headers=ADMIN
        )
        assert r.status_code == 200 and r.json()["faults"] == ["pump_failure"]

        _, drained = await log.wait_for("rack-a", RackStateKind.RACK_STATE_DRAIN)
        assert "coolant flow" in drained.reason
        assert "both-1" in drained.worker_ids and drained.max_seqs_per_worker == 0
        await asyncio.sleep(0.1)
        assert tracker.state_for_worker("prefill-1").state == "drain"
        assert tracker.state_for_worker("decode-2").state == "normal"
        rack = (await api.get("/v1/racks/rack-a")).json()
        assert rack["state"] == "drain" and rack["faults"] == ["pump_failure"]
        assert rack["latest_reading"]["flow_lpm"] == pytest.approx(3.0)
        metrics = (await api.get("/metrics")).text
        assert 'tokenyard:rack_state{rack="rack-a",site="local",state="drain"} 1.0' in metrics
        assert 'tokenyard:rack_state{rack="rack-a",site="local",state="normal"} 0.0' in metrics
        assert 'tokenyard:rack_coolant_flow_lpm{rack="rack-a",site="local"} 3.0' in metrics
        assert (await api.get("/ready")).json() == {"ready": True, "reason": None}

        cleared = time.monotonic()
        assert (await api.delete("/v1/admin/racks/rack-a/faults", headers=ADMIN)).json()[
            "faults"
        ] == []
        at, _ = await log.wait_for("rack-a", RackStateKind.RACK_STATE_NORMAL, timeout=DWELL_S + 5)
        assert at - cleared >= DWELL_S
        events = (await api.get("/v1/events", params={"rack": "rack-a"})).json()["events"]
        assert [(e["from_state"], e["to_state"]) for e in events] == [
            ("normal", "drain"),
            ("drain", "normal"),
        ]
        assert events[0]["reading"]["flow_lpm"] == pytest.approx(3.0)  # the reading that caused it
        assert "coolant flow" in events[0]["reason"]
        b = (await api.get("/v1/racks/rack-b")).json()
        assert b["state"] == "normal"


async def test_chiller_power_cap_and_dead_sensor(settings: FacilitiesSettings, bus: Bus) -> None:
    log, _ = await watch(bus)
    async with running(settings) as api:
        await api.post(
            "/v1/admin/racks/rack-a/faults", json={"kind": "chiller_failure"}, headers=ADMIN
        )
        _, msg = await log.wait_for("rack-a", RackStateKind.RACK_STATE_DRAIN)
        assert "coolant supply" in msg.reason
        # Idle power is 1.5 kW: a 1.5 kW cap is 100% of it (derate band 95%..105%).
        await api.post(
            "/v1/admin/racks/rack-b/faults",
            json={"kind": "power_cap", "power_cap_kw": 1.5},
            headers=ADMIN,
        )
        _, msg = await log.wait_for("rack-b", RackStateKind.RACK_STATE_DERATE)
        assert "power 1.5 kW is 100%" in msg.reason
        # A derate on power alone steers (power_pressure) and caps no sequences.
        assert msg.max_seqs_per_worker == 8 and msg.seq_fraction == 1.0
        assert msg.power_pressure == 1.0
        assert (await api.get("/v1/racks/rack-b")).json()["power_cap_kw"] == 1.5
        await api.delete("/v1/admin/racks/rack-b/faults", headers=ADMIN)
        await log.wait_for("rack-b", RackStateKind.RACK_STATE_NORMAL, timeout=DWELL_S + 5)
        await api.post("/v1/admin/racks/rack-b/faults", json={"kind": "dead_sensor"}, headers=ADMIN)
        _, msg = await log.wait_for("rack-b", RackStateKind.RACK_STATE_DERATE)
        assert "no reading for" in msg.reason


async def test_external_readings_are_consumed_and_silence_is_stale(
    tmp_path: Path, settings: FacilitiesSettings, bus: Bus
) -> None:
    inventory = yaml.safe_load(settings.inventory_path.read_text())
    inventory["racks"][1]["source"] = "external"
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(inventory))
    log, _ = await watch(bus)
    async with running(settings.model_copy(update={"inventory_path": path})) as api:
        _, msg = await log.wait_for("rack-b", RackStateKind.RACK_STATE_DERATE)  # never heard from
        assert "no reading yet" in msg.reason

        async def publish(power_kw: float, flow: float) -> None:
            reading = FacilityReading(
                rack="rack-b",
                ts_unix_s=time.time(),
                power_kw=power_kw,
                flow_lpm=flow,
                supply_c=25.0,
                return_c=30.0,
                source="redfish",
            )
            await bus.publish(subjects.facilities_readings("rack-b"), reading)

        await publish(9.0, 30.0)  # 112% of the 8 kW cap: power derates (it never drains)
        for _ in range(5):  # the stale derate's republishing may come first
            _, msg = await log.wait_for("rack-b", RackStateKind.RACK_STATE_DERATE)
            if "power 9.0 kW" in msg.reason:
                break
        assert "power 9.0 kW" in msg.reason and msg.power_pressure == 1.0
        for _ in range(int((DWELL_S + 1.5) / 0.2)):
            await publish(4.0, 30.0)
            await asyncio.sleep(0.2)
        await log.wait_for("rack-b", RackStateKind.RACK_STATE_NORMAL, timeout=0.5)
        readings = (await api.get("/v1/racks/rack-b/readings")).json()["readings"]
        assert readings[0]["source"] == "redfish" and readings[0]["power_kw"] == 9.0
        assert readings[0]["inlet_air_c"] is None


async def test_admin_auth_and_errors(settings: FacilitiesSettings) -> None:
    async with running(settings) as api:
        body = {"kind": "pump_failure"}
        r = await api.post("/v1/admin/racks/rack-a/faults", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await api.post(
            "/v1/admin/racks/rack-a/faults", json=body, headers={"X-Admin-Token": "wrong"}
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_admin_token"
        r = await api.post("/v1/admin/racks/nope/faults", json=body, headers=ADMIN)
        assert r.status_code == 404 and r.json()["error"]["param"] == "rack"
        r = await api.post("/v1/admin/racks/rack-a/faults", json={"kind": "meteor"}, headers=ADMIN)
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request_error"
        r = await api.post(
            "/v1/admin/racks/rack-a/faults", json={"kind": "power_cap"}, headers=ADMIN
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "power_cap_kw"
        r = await api.get(
            "/v1/events", params={"start": "2030-01-01T00:00:00Z", "end": "2029-01-01T00:00:00Z"}
        )
        assert r.status_code == 400
        inventory = (await api.get("/v1/inventory")).json()
        assert [rack["name"] for rack in inventory["racks"]] == ["rack-a", "rack-b"]
        racks = (await api.get("/v1/racks")).json()["racks"]
        assert {rack["name"] for rack in racks} == {"rack-a", "rack-b"}


async def test_a_restart_resumes_the_recorded_state(settings: FacilitiesSettings) -> None:
    async with running(settings) as api:
        await api.post(
            "/v1/admin/racks/rack-a/faults", json={"kind": "pump_failure"}, headers=ADMIN
        )
        for _ in range(50):
            if (await api.get("/v1/racks/rack-a")).json()["state"] == "drain":
                break
            await asyncio.sleep(0.1)
    # Faults are not persisted (they are tests), but the drain is: it ends only after the dwell.
    async with running(settings) as api:
        assert (await api.get("/v1/racks/rack-a")).json()["state"] == "drain"


@pytest.mark.slow  # a fresh interpreter importing FastAPI, SQLAlchemy, NATS: slow on a busy machine
def test_module_runs_standalone_and_stops_on_sigterm(
    tmp_path: Path, nats_url: str, example_inventory: Path
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "TOKENYARD_FACILITIES_NATS_URL": nats_url,
        "TOKENYARD_FACILITIES_INVENTORY_PATH": str(example_inventory),
        "TOKENYARD_FACILITIES_DATA_DIR": str(tmp_path),
        "TOKENYARD_FACILITIES_PORT": str(port),
        "TOKENYARD_FACILITIES_GRPC_PORT": str(free_port()),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenyard.services.facilities"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def beat(bus: Bus, role: str, worker_id: str, running: int, waiting: int) -> None:
    hb = WorkerHeartbeat(
        worker_id=worker_id, role=role, model="m", num_running=running, num_waiting=waiting,
        max_num_seqs=8, heartbeat_interval_ms=200,
    )  # fmt: skip
    await bus.publish(subjects.heartbeat(role, worker_id), hb)


async def test_desired_replicas_for_compose_and_keda(settings: FacilitiesSettings, bus: Bus):
    """An overloaded decode pool: the HTTP route and the KEDA external scaler (real gRPC)
    both say how many decode workers should run; a trigger without a role is refused."""
    settings = settings.model_copy(
        update={
            "autoscale_mode": "sla",
            "autoscale_interval_s": 0.2,
            "autoscale_max_decode": 3,
            "scaler_port": free_port(),
        }  # fmt: skip
    )
    async with running(settings) as api:
        for _ in range(10):  # a second of heartbeats: decode-2 full with as many queued
            await beat(bus, "prefill", "prefill-1", 4, 0)
            await beat(bus, "decode", "decode-2", 8, 8)
            await asyncio.sleep(0.1)
        body = (await api.get("/v1/autoscale/desired")).json()
        assert body["mode"] == "sla" and body["live"] == {"prefill": 1, "decode": 1}
        # demand 2 (busy 1 + 8 queued / 8 seqs) over the 0.6 target: 4, capped at 3
        assert body["desired"] == {"prefill": 1, "decode": 3}, body
        assert any("decode: up 1 -> 3" in r for r in body["reasons"])

        channel = grpc.aio.insecure_channel(f"127.0.0.1:{settings.scaler_port}")
        scaler = externalscaler_pb2_grpc.ExternalScalerStub(channel)
        ref = epb.ScaledObjectRef(name="decode", namespace="ty", scalerMetadata={"role": "decode"})
        spec = await scaler.GetMetricSpec(ref)
        assert [(m.metricName, m.targetSize) for m in spec.metricSpecs] == [
            ("tokenyard-desired-decode", 1)
        ]
        got = await scaler.GetMetrics(
            epb.GetMetricsRequest(scaledObjectRef=ref, metricName="tokenyard-desired-decode")
        )
        assert [v.metricValue for v in got.metricValues] == [3]
        assert (await scaler.IsActive(ref)).result is True
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await scaler.IsActive(epb.ScaledObjectRef(name="x", scalerMetadata={"role": "both"}))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await channel.close()
