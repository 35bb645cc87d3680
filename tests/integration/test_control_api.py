"""The gRPC control APIs of the KV-cache and facilities services, over real gRPC (and real
NATS and SQLite for the facilities service), and `tokenyard ctl` against them."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from test_facilities_service import TOKEN, StateLog, running

from tokenyard.bus import subjects
from tokenyard.bus.embedded import free_port
from tokenyard.bus.nats import Bus
from tokenyard.grpc_security import OPERATOR, GrpcSecurity, fresh_tokens, open_channel, peers_text
from tokenyard.kv.hashing import prefix_block_hashes
from tokenyard.kv.layout import KVLayout, layout_to_proto
from tokenyard.kv.store.client import KVCacheClient
from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.services.kvcache.server import KVCacheServer, serve
from tokenyard.services.kvcache.settings import KVCacheSettings
from tokenyard.v1 import control_pb2 as cpb
from tokenyard.v1 import control_pb2_grpc, kv_pb2
from tokenyard.v1.facilities_pb2 import RackState, RackStateKind

LAYOUT = KVLayout("tiny", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
TOKENS = fresh_tokens()
PEERS = peers_text(TOKENS)
WORKER = GrpcSecurity(token=TOKENS["prefill"])


# --- KV-cache service --------------------------------------------------------------------


@pytest.fixture
async def kvcache() -> AsyncIterator[KVCacheServer]:
    security = GrpcSecurity(peers=PEERS)
    server = await serve(KVCacheSettings(port=0, ram_bytes=1 << 20, shutdown_grace_s=0), security)
    yield server
    await server.stop()


def admin_stub(endpoint: str, token: str | None) -> tuple[grpc.aio.Channel, Any]:
    channel = open_channel(endpoint, [], GrpcSecurity(token=token or ""))
    return channel, control_pb2_grpc.KVCacheAdminStub(channel)


async def test_kvcache_stats_move_after_a_put_and_a_get(kvcache):
    channel, admin = admin_stub(kvcache.endpoint, TOKENS[OPERATOR])
    before = await admin.Stats(kv_pb2.StatsRequest())
    assert (before.hits, before.misses) == (0, 0)
    assert [t.blocks for t in before.tiers] == [0]
    hashes = prefix_block_hashes(list(range(12)), LAYOUT.block_size)  # 3 blocks
    pool = torch.randn(LAYOUT.pool_shape(6))
    async with KVCacheClient(kvcache.endpoint, security=WORKER) as worker:
        assert await worker.put_blocks(LAYOUT, hashes[:2], pool, [0, 1]) == 2
        assert await worker.get_prefix(LAYOUT, hashes, pool, [3, 4, 5]) == 2  # third: a miss
    after = await admin.Stats(kv_pb2.StatsRequest())
    assert (after.hits, after.misses) == (2, 1)
    (ram,) = after.tiers
    assert (ram.name, ram.blocks, ram.hits, ram.misses) == ("ram", 2, 2, 1)
    assert ram.bytes == 2 * (LAYOUT.block_nbytes + 4)  # each block framed with its crc32

    evicted = await admin.EvictPrefix(
        cpb.EvictPrefixRequest(layout=layout_to_proto(LAYOUT), hashes=hashes)
    )
    assert evicted.num_evicted == 2
    assert (await admin.Stats(kv_pb2.StatsRequest())).tiers[0].blocks == 0
    await channel.close()


async def test_kvcache_clear_drops_every_block(kvcache):
    hashes = prefix_block_hashes(list(range(16)), LAYOUT.block_size)
    async with KVCacheClient(kvcache.endpoint, security=WORKER) as worker:
        await worker.put_blocks(LAYOUT, hashes, torch.randn(LAYOUT.pool_shape(4)), [0, 1, 2, 3])
        channel, admin = admin_stub(kvcache.endpoint, TOKENS[OPERATOR])
        cleared = await admin.Clear(cpb.ClearRequest())
        assert (cleared.blocks, cleared.bytes) == (4, 4 * (LAYOUT.block_nbytes + 4))
        assert await worker.contains(LAYOUT, hashes) == 0
    await channel.close()


@pytest.mark.parametrize(
    ("token", "code"),
    [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("wrong-token", grpc.StatusCode.UNAUTHENTICATED),
        (TOKENS["prefill"], grpc.StatusCode.PERMISSION_DENIED),  # a worker is no operator
        (TOKENS["decode"], grpc.StatusCode.PERMISSION_DENIED),
    ],
)
async def test_kvcache_admin_takes_the_operator_token_only(kvcache, token, code):
    channel, admin = admin_stub(kvcache.endpoint, token)
    for call, request in (
        (admin.Stats, kv_pb2.StatsRequest()),
        (admin.Clear, cpb.ClearRequest()),
        (admin.EvictPrefix, cpb.EvictPrefixRequest(layout=layout_to_proto(LAYOUT), hashes=[1])),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(request)
        assert refused.value.code() == code
    await channel.close()


async def ctl(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tokenyard.cli",
        "ctl",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.slow
async def test_ctl_kvcache_stats_and_a_refusal(kvcache):
    rc, out, err = await ctl("--token", TOKENS[OPERATOR], "kvcache", "stats", kvcache.endpoint)
    assert rc == 0, err
    stats = json.loads(out)
    assert stats["tiers"][0]["name"] == "ram" and stats["hits"] == "0"
    rc, out, err = await ctl("kvcache", "stats", kvcache.endpoint)  # no token anywhere
    assert rc == 1 and "UNAUTHENTICATED" in err and not out


# --- facilities service ------------------------------------------------------------------


@pytest.fixture
def fsettings(tmp_path: Path, nats_url: str, example_inventory: Path) -> FacilitiesSettings:
    return FacilitiesSettings(
        nats_url=nats_url,
        data_dir=tmp_path,
        inventory_path=example_inventory,
        admin_token=TOKEN,
        port=free_port(),
        grpc_port=free_port(),
        tick_s=0.2,
        dwell_s=1.5,
        stale_after_s=1.0,
        state_heartbeat_s=0.5,
        sim_time_constant_s=0.0,
    )


def facilities_stub(settings: FacilitiesSettings, token: str) -> tuple[grpc.aio.Channel, Any]:
    channel = open_channel(f"127.0.0.1:{settings.grpc_port}", [], GrpcSecurity(token=token))
    return channel, control_pb2_grpc.FacilitiesControlStub(channel)


async def test_fault_a_rack_over_grpc_and_see_its_state(fsettings, nats_url):
    bus = await Bus.connect(nats_url, name="control-test")
    states = StateLog()
    await bus.subscribe(subjects.FACILITIES_STATE_ALL, RackState, states.on_state)
    async with running(fsettings) as http:
        channel, stub = facilities_stub(fsettings, TOKEN)
        racks = await stub.ListRacks(cpb.ListRacksRequest())
        assert sorted(r.state.rack for r in racks.racks) == ["rack-a", "rack-b"]
        info = await stub.SetFault(cpb.SetFaultRequest(rack="rack-a", kind="pump_failure"))
        assert list(info.faults) == ["pump_failure"]
        # The simulated loop loses its flow: the rack drains on its readings.
        await states.wait_for("rack-a", RackStateKind.RACK_STATE_DRAIN, timeout=20)
        (rack_a,) = [
            r
            for r in (await stub.ListRacks(cpb.ListRacksRequest())).racks
            if r.state.rack == "rack-a"
        ]
        assert rack_a.state.state == RackStateKind.RACK_STATE_DRAIN and not rack_a.operator_drain
        assert "flow" in rack_a.state.reason
        # REST sees the same rack, through the same code path.
        rest = (await http.get("/v1/racks/rack-a")).json()
        assert rest["state"] == "drain" and rest["faults"] == ["pump_failure"]
        cleared = await stub.ClearFaults(cpb.RackRequest(rack="rack-a"))
        assert list(cleared.faults) == []
        await channel.close()
    await bus.close()


async def test_operator_drain_and_undrain_of_a_rack(fsettings, nats_url):
    bus = await Bus.connect(nats_url, name="control-test")
    states = StateLog()
    await bus.subscribe(subjects.FACILITIES_STATE_ALL, RackState, states.on_state)
    async with running(fsettings) as http:
        channel, stub = facilities_stub(fsettings, TOKEN)
        await states.wait_for("rack-b", RackStateKind.RACK_STATE_NORMAL, timeout=20)
        info = await stub.DrainRack(cpb.DrainRackRequest(rack="rack-b", reason="coolant work"))
        assert info.state.state == RackStateKind.RACK_STATE_DRAIN and info.operator_drain
        assert info.state.reason == "drained by an operator: coolant work"
        _, published = await states.wait_for("rack-b", RackStateKind.RACK_STATE_DRAIN)
        assert published.max_seqs_per_worker == 0
        await asyncio.sleep(3 * fsettings.tick_s)  # calm readings do not lift it
        assert (await http.get("/v1/racks/rack-b")).json()["state"] == "drain"
        info = await stub.UndrainRack(cpb.RackRequest(rack="rack-b"))
        assert info.state.state == RackStateKind.RACK_STATE_NORMAL and not info.operator_drain
        await states.wait_for("rack-b", RackStateKind.RACK_STATE_NORMAL)
        # The REST adapter drains through the same RackControl.
        headers = {"Authorization": f"Bearer {TOKEN}"}
        r = await http.post(
            "/v1/admin/racks/rack-a/drain", json={"reason": "rest"}, headers=headers
        )
        assert r.status_code == 200 and r.json()["operator_drain"] is True
        (rack_a,) = [
            x
            for x in (await stub.ListRacks(cpb.ListRacksRequest())).racks
            if x.state.rack == "rack-a"
        ]
        assert rack_a.operator_drain and rack_a.state.reason == "drained by an operator: rest"
        await channel.close()
    await bus.close()


async def test_facilities_control_refusals(fsettings):
    async with running(fsettings):
        channel, stranger = facilities_stub(fsettings, "")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stranger.DrainRack(cpb.DrainRackRequest(rack="rack-a"))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await channel.close()
        channel, wrong = facilities_stub(fsettings, "not-the-token")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await wrong.SetFault(cpb.SetFaultRequest(rack="rack-a", kind="pump_failure"))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await channel.close()
        channel, admin = facilities_stub(fsettings, TOKEN)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await admin.SetFault(cpb.SetFaultRequest(rack="rack-z", kind="pump_failure"))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await admin.SetFault(cpb.SetFaultRequest(rack="rack-a", kind="power_cap"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "power_cap_kw" in (refused.value.details() or "")
        assert len((await admin.ListRacks(cpb.ListRacksRequest())).racks) == 2
        await channel.close()


async def test_facilities_reads_take_the_operator_token_and_no_worker_token(fsettings, monkeypatch):
    monkeypatch.setenv("TOKENYARD_GRPC_PEERS", PEERS)
    async with running(fsettings):
        for token, code in (
            (TOKENS[OPERATOR], grpc.StatusCode.OK),
            (TOKENS["decode"], grpc.StatusCode.PERMISSION_DENIED),
            ("not-a-token", grpc.StatusCode.UNAUTHENTICATED),
        ):
            channel, stub = facilities_stub(fsettings, token)
            try:
                await stub.ListRacks(cpb.ListRacksRequest())
                outcome = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                outcome = exc.code()
            finally:
                await channel.close()
            assert outcome == code, token
        channel, operator = facilities_stub(fsettings, TOKENS[OPERATOR])
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # changes need the admin token
            await operator.DrainRack(cpb.DrainRackRequest(rack="rack-a"))
        await channel.close()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_rest_admin_still_answers_as_before(fsettings):
    async with running(fsettings) as http:
        r = await http.post("/v1/admin/racks/rack-a/faults", json={"kind": "pump_failure"})
        assert r.status_code == 401
        r = await http.post(
            "/v1/admin/racks/rack-a/faults",
            json={"kind": "power_cap"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "power_cap_kw"
        r = await http.delete("/v1/admin/racks/nope/drain", headers={"X-Admin-Token": TOKEN})
        assert r.status_code == 404


@pytest.mark.slow
async def test_ctl_drains_and_undrains_a_rack(fsettings):
    addr = f"127.0.0.1:{fsettings.grpc_port}"
    async with running(fsettings) as http:
        rc, out, err = await ctl(
            "facilities",
            "--addr",
            addr,
            "--admin-token",
            TOKEN,
            "drain",
            "rack-a",
            "--reason",
            "ctl",
        )
        assert rc == 0, err
        drained = json.loads(out)
        assert drained["operatorDrain"] is True and drained["state"]["state"] == "RACK_STATE_DRAIN"
        assert (await http.get("/v1/racks/rack-a")).json()["state"] == "drain"
        rc, out, err = await ctl("facilities", "--addr", addr, "drain", "rack-a")  # no token
        assert rc == 1 and "UNAUTHENTICATED" in err
        rc, out, err = await ctl(
            "facilities", "--addr", addr, "--admin-token", TOKEN, "undrain", "rack-a"
        )
        assert rc == 0 and json.loads(out)["operatorDrain"] is False


async def test_an_operator_drain_survives_a_restart(fsettings):
    async with running(fsettings):
        channel, stub = facilities_stub(fsettings, TOKEN)
        await stub.DrainRack(cpb.DrainRackRequest(rack="rack-b", reason="maintenance"))
        await channel.close()
    async with running(fsettings) as http:  # same database
        rack_b = (await http.get("/v1/racks/rack-b")).json()
        assert rack_b["state"] == "drain" and rack_b["operator_drain"] is True
        assert rack_b["reason"] == "drained by an operator: maintenance"
        channel, stub = facilities_stub(fsettings, TOKEN)
        info = await stub.UndrainRack(cpb.RackRequest(rack="rack-b"))
        assert not info.operator_drain and info.state.state != RackStateKind.RACK_STATE_DRAIN
        await channel.close()
