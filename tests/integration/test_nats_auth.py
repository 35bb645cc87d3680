"""Per-service NATS users on a real nats-server: anonymous refused, each user publishes and
reads only what its role needs (forged heartbeats, rack states and token reads go nowhere)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import nats
import pytest

import infra
from tokenyard.bus import auth, subjects
from tokenyard.bus.nats import Bus, BusError
from tokenyard.v1 import serving_pb2 as pb

WORKER = auth.worker("decode", "decode-1")
USERS = {
    "operator": auth.operator(),
    "router": auth.router(),
    "gateway": auth.gateway("gw-a"),
    "gateway-b": auth.gateway("gw-b"),
    "worker": WORKER,
    "facilities": auth.facilities(),
    "telemetry": auth.telemetry(),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with infra.nats_with_users(list(USERS.values()), tmp_path_factory.mktemp("nats-auth")) as url:
        yield url


@pytest.fixture
async def connect(server: str) -> AsyncIterator:
    async with infra.buses_as(USERS, server) as open_as:
        yield open_as


async def collect(bus: Bus, subject: str) -> list[str]:
    got: list[str] = []

    async def on(message: pb.WorkerHeartbeat, msg) -> None:
        got.append(msg.subject)

    await bus.subscribe(subject, pb.WorkerHeartbeat, on)
    await bus.sync()
    return got


async def test_anonymous_and_wrong_password_are_refused(server: str):
    # nats-py retries a refused first connection until Bus.connect gives up.
    with pytest.raises(BusError, match="cannot connect"):
        await Bus.connect(server, name="stranger", first_connect_timeout=3)
    forged = auth.NatsUser("router", publish=[], subscribe=[], password="guess")
    with pytest.raises(BusError) as info:
        await Bus.connect(forged.url(server), name="stranger", first_connect_timeout=3)
    assert "guess" not in str(info.value)  # the password never reaches a message or a log


async def test_a_worker_publishes_only_its_own_heartbeats(connect):
    seen = await collect(await connect("operator"), subjects.HEARTBEATS_ALL)
    worker = await connect("worker")
    await worker.publish(subjects.heartbeat("decode", "decode-1"), pb.WorkerHeartbeat())
    await worker.publish(subjects.heartbeat("decode", "decode-9"), pb.WorkerHeartbeat())
    await worker.publish(subjects.facilities_state("rack-a"), pb.WorkerHeartbeat())
    await worker.sync()
    assert await _eventually(lambda: seen)
    await asyncio.sleep(0.3)
    assert seen == [subjects.heartbeat("decode", "decode-1")]


async def test_only_the_gateway_reads_tokens_and_only_facilities_sets_rack_states(connect):
    operator = await connect("operator")
    gateway_seen = await collect(await connect("gateway"), subjects.tokens("gw-a", "*", "*"))
    worker_seen = await collect(await connect("worker"), subjects.tokens("*", "*", "*"))
    telemetry_seen = await collect(await connect("telemetry"), subjects.FACILITIES_STATE_ALL)
    await operator.publish(subjects.tokens("gw-a", "r1", "decode-1"), pb.WorkerHeartbeat())
    gateway = await connect("gateway")
    await gateway.publish(subjects.facilities_state("rack-a"), pb.WorkerHeartbeat())
    facilities = await connect("facilities")
    await facilities.publish(subjects.facilities_state("rack-b"), pb.WorkerHeartbeat())
    assert await _eventually(lambda: gateway_seen and telemetry_seen)
    await asyncio.sleep(0.3)
    assert gateway_seen == [subjects.tokens("gw-a", "r1", "decode-1")] and worker_seen == []
    assert telemetry_seen == [subjects.facilities_state("rack-b")]


async def test_the_router_answers_route_requests_but_publishes_nothing_else(connect):
    router = await connect("router")

    async def on_route(req: pb.RouteRequest, msg) -> None:
        await router.reply(msg, pb.RouteReply(placement=pb.Placement(prefill_worker_id="p")))
        await router.publish(
            subjects.tokens("gw-a", req.request_id, "decode-1"), pb.WorkerHeartbeat()
        )

    await router.subscribe(subjects.ROUTER_ROUTE, pb.RouteRequest, on_route)
    await router.sync()
    gateway = await connect("gateway")
    tokens = await collect(gateway, subjects.tokens("gw-a", "*", "*"))
    reply = await gateway.request(
        subjects.ROUTER_ROUTE, pb.RouteRequest(request_id="r2"), pb.RouteReply, timeout=2
    )
    assert reply.placement.prefill_worker_id == "p"
    await asyncio.sleep(0.3)
    assert tokens == []


async def test_a_gateway_cannot_read_or_cancel_another_gateways_requests(server: str, connect):
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    other = await nats.connect(
        USERS["gateway-b"].url(server), error_cb=on_error, max_reconnect_attempts=0
    )
    try:
        got: list[str] = []

        async def on(msg) -> None:
            got.append(msg.subject)

        await other.subscribe(subjects.tokens("gw-a", "*", "*"), cb=on)
        await other.subscribe(subjects.tokens("gw-a", "r7", "decode-1"), cb=on)
        await other.subscribe(subjects.tokens("gw-b", "*", "*"), cb=on)  # its own: allowed
        await other.flush()
        await other.flush()
        # The server refuses both subscriptions by name ...
        assert await _eventually(lambda: len(errors) >= 2), errors
        refused = " ".join(str(e) for e in errors)
        assert "permissions violation for subscription" in refused, refused
        assert (
            subjects.tokens("gw-a", "*", "*") in refused
            and subjects.tokens("gw-a", "r7", "decode-1") in refused
        )
        # ... and delivers nothing of gw-a's to it, while its own tokens still come.
        operator = await connect("operator")
        await operator.publish(subjects.tokens("gw-a", "r7", "decode-1"), pb.WorkerHeartbeat())
        await operator.publish(subjects.tokens("gw-b", "r8", "decode-1"), pb.WorkerHeartbeat())
        await operator.sync()
        assert await _eventually(lambda: got)
        await asyncio.sleep(0.3)
        assert got == [subjects.tokens("gw-b", "r8", "decode-1")]
        # Nor may it cancel gw-a's requests.
        cancels = await collect(operator, subjects.CANCEL_ALL)
        await other.publish(subjects.cancel("gw-a", "r7"), b"")
        await other.publish(subjects.cancel("gw-b", "r8"), b"")
        await other.flush()
        assert await _eventually(lambda: cancels)
        await asyncio.sleep(0.3)
        assert cancels == [subjects.cancel("gw-b", "r8")]
        assert "permissions violation for publish" in " ".join(str(e) for e in errors)
    finally:
        await other.close()


async def _eventually(predicate, timeout: float = 3.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return bool(predicate())
