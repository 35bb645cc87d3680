"""Insiders on a real nats-server with the generated users (tokenyard.bus.auth): what a
stolen service password could do before, each tried as the insider it needs, now fails.

- telemetry (or any service) reading a prompt from another user's inbox: a route request's
  answer, a prefill job JetStream hands its puller;
- a worker's password speaking for another worker: heartbeats and KV events with another
  worker's id in the payload (the readers take the id from the subject);
- a worker making a consumer on another worker's jobs, or pulling from that worker's own;
- the gateway's password deleting or purging the prefill stream (and the gateway makes a
  lost stream again, not ready meanwhile);
- a worker's password sending token chunks for a request it was not given, or claiming a
  tiny context to shorten the gateway's limit for everyone;
- the router's password moving a live worker's request to another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import nats
import pytest
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig

import infra
from tokenyard.bus import auth, subjects
from tokenyard.bus.nats import Bus
from tokenyard.bus.senders import subscribe_heartbeats, subscribe_kv_events
from tokenyard.bus.workqueue import WorkQueueSpec
from tokenyard.services.gateway.backend import NatsBackend
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.services.launch.stack import StackConfig
from tokenyard.services.worker.prefill import CONSUMER_PREFIX
from tokenyard.v1 import serving_pb2 as pb

GATEWAY_ID = "gw-a"
VICTIM, THIEF = "prefill-1", "prefill-2"
USERS = {
    "operator": auth.operator(),
    "router": auth.router(),
    "gateway": auth.gateway(GATEWAY_ID),
    "victim": auth.worker("prefill", VICTIM),
    "thief": auth.worker("prefill", THIEF),
    "telemetry": auth.telemetry(),
    "facilities": auth.facilities(),
}
PROMPT = [31, 41, 59, 26, 53, 58, 97]
DENIED_S = 1.0  # a request on a subject the user may not publish on gets no answer
QUIET_S = 0.4  # how long "nothing arrives" is watched for


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with infra.nats_with_users(
        list(USERS.values()), tmp_path_factory.mktemp("nats-insiders")
    ) as url:
        yield url


@pytest.fixture
async def connect(server: str) -> AsyncIterator[Callable[[str], Awaitable[Bus]]]:
    async with infra.buses_as(USERS, server) as open_as:
        yield open_as


@pytest.fixture
async def stream(connect) -> AsyncIterator[None]:
    """The prefill stream, made afresh by its owner for each test."""
    operator = await connect("operator")
    await operator.ensure_work_queue(subjects.PREFILL_STREAM, subjects.PREFILL_SUBJECTS)
    yield
    await operator.js.delete_stream(subjects.PREFILL_STREAM)


async def eavesdropper(server: str, name: str, subject: str) -> tuple[nats.NATS, list, list]:
    """A raw connection as `name` subscribed to `subject`: what it got, and its errors."""
    got: list[Msg] = []
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    async def on_msg(msg: Msg) -> None:
        got.append(msg)

    nc = await nats.connect(USERS[name].url(server), error_cb=on_error, max_reconnect_attempts=0)
    await nc.subscribe(subject, cb=on_msg)
    await nc.flush()
    return nc, got, errors


async def eventually(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return bool(predicate())


async def settles(check: Callable[[], Awaitable[bool]], timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.1)
    return False


def own_consumer(worker_id: str) -> ConsumerConfig:
    """The consumer a prefill worker makes (tokenyard.services.worker.prefill)."""
    spec = WorkQueueSpec(
        stream=subjects.PREFILL_STREAM,
        subjects=subjects.PREFILL_SUBJECTS,
        consumer_prefix=CONSUMER_PREFIX,
        subject_for=subjects.prefill_worker_jobs,
        ack_wait_s=5,
        max_deliver=3,
        max_in_flight=1,
    )
    return spec.consumer_config(worker_id)


# --- inboxes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spy", ["telemetry", "facilities", "thief"])
async def test_no_service_reads_a_route_request_answered_in_anothers_inbox(server, connect, spy):
    router = await connect("router")

    async def on_route(req: pb.RouteRequest, msg: Msg) -> None:
        await router.reply(msg, pb.RouteReply(placement=pb.Placement(prefill_worker_id=VICTIM)))

    await router.subscribe(subjects.ROUTER_ROUTE, pb.RouteRequest, on_route)
    await router.sync()
    nc, got, errors = await eavesdropper(server, spy, "_INBOX.>")
    try:
        gateway = await connect("gateway")
        request = pb.RouteRequest(request_id="r1", num_prompt_tokens=len(PROMPT))
        reply = await gateway.request(subjects.ROUTER_ROUTE, request, pb.RouteReply, timeout=3)
        assert reply.placement.prefill_worker_id == VICTIM  # the gateway's own inbox works
        assert await eventually(lambda: errors), "the server did not refuse _INBOX.>"
        assert "permissions violation for subscription" in str(errors[0]).lower()
        await asyncio.sleep(QUIET_S)
        assert got == []
        # Nor the gateway's own inbox by its name.
        await nc.subscribe(f"{auth.inbox_prefix(USERS['gateway'].name)}.>")
        await nc.flush()
        assert await eventually(lambda: len(errors) >= 2)
    finally:
        await nc.close()


async def test_telemetry_does_not_read_a_prefill_job_jetstream_hands_a_worker(
    server, connect, stream
):
    victim = await connect("victim")
    await victim.js.add_consumer(subjects.PREFILL_STREAM, own_consumer(VICTIM))
    psub = await victim.js.pull_subscribe_bind(
        own_consumer(VICTIM).durable_name, subjects.PREFILL_STREAM
    )
    nc, got, errors = await eavesdropper(server, "telemetry", "_INBOX.>")
    try:
        gateway = await connect("gateway")
        job = pb.PrefillJob(request_id="r2", prompt_token_ids=PROMPT, gateway_id=GATEWAY_ID)
        await gateway.js_publish(subjects.prefill_worker_jobs(VICTIM), job)
        msgs = await psub.fetch(1, timeout=3)
        assert msgs[0].subject == subjects.prefill_worker_jobs(VICTIM)
        assert pb.PrefillJob.FromString(msgs[0].data).prompt_token_ids == PROMPT
        await msgs[0].ack()
        assert await eventually(lambda: errors)
        await asyncio.sleep(QUIET_S)
        assert got == []  # the delivery went to _INBOX.worker-prefill-1, out of its reach
    finally:
        await nc.close()


# --- identities bound to subjects ------------------------------------------------------------


async def test_a_worker_cannot_speak_for_another_in_heartbeats_or_kv_events(server, connect):
    router = await connect("router")
    beats: list[pb.WorkerHeartbeat] = []
    events: list[pb.KVEvent] = []

    async def on_beat(hb: pb.WorkerHeartbeat, _msg: Msg) -> None:
        beats.append(hb)

    async def on_event(event: pb.KVEvent, _msg: Msg) -> None:
        events.append(event)

    await subscribe_heartbeats(router, on_beat)
    await subscribe_kv_events(router, on_event)
    await router.sync()
    thief = await connect("thief")
    own = subjects.heartbeat("prefill", THIEF)
    # On its own subject (the only one it may publish on), in the victim's name: dropped.
    await thief.publish(own, pb.WorkerHeartbeat(worker_id=VICTIM, role="prefill", max_model_len=1))
    await thief.publish(own, pb.WorkerHeartbeat(worker_id=THIEF, role="decode"))  # wrong role
    stolen = pb.KVEvent(worker_id=VICTIM, kind=pb.KVEvent.STORED, block_hashes=[1, 2, 3])
    await thief.publish(subjects.kv_events(THIEF), stolen)
    # On the victim's subject: refused by the server.
    await thief.publish(
        subjects.heartbeat("prefill", VICTIM), pb.WorkerHeartbeat(worker_id=VICTIM, role="prefill")
    )
    await thief.publish(subjects.kv_events(VICTIM), stolen)
    # What it says of itself still counts.
    await thief.publish(own, pb.WorkerHeartbeat(worker_id=THIEF, role="prefill"))
    await thief.publish(subjects.kv_events(THIEF), pb.KVEvent(worker_id=THIEF, seq=1))
    await thief.sync()
    assert await eventually(lambda: beats and events)
    await asyncio.sleep(QUIET_S)
    assert [(b.worker_id, b.role) for b in beats] == [(THIEF, "prefill")]
    assert [(e.worker_id, e.seq) for e in events] == [(THIEF, 1)]


async def test_the_gateway_keeps_a_forged_heartbeat_out_of_its_fleet(server, connect, stream):
    settings = GatewaySettings(nats_url=USERS["gateway"].url(server), instance_id=GATEWAY_ID)
    backend = NatsBackend(settings)
    await backend.start()
    try:
        thief = await connect("thief")
        own = subjects.heartbeat("prefill", THIEF)
        forged = pb.WorkerHeartbeat(
            worker_id=VICTIM, role="prefill", max_model_len=1, heartbeat_interval_ms=1000
        )
        await thief.publish(own, forged)
        honest = pb.WorkerHeartbeat(
            worker_id=THIEF, role="prefill", max_model_len=4096, heartbeat_interval_ms=1000
        )
        await thief.publish(own, honest)
        await thief.sync()
        assert await eventually(lambda: THIEF in backend.fleet)
        await asyncio.sleep(QUIET_S)
        assert VICTIM not in backend.fleet
        assert backend.fleet.max_model_len(asyncio.get_running_loop().time()) in (0, 4096)
    finally:
        await backend.stop()


# --- JetStream: consumers and the stream -----------------------------------------------------


async def test_a_worker_makes_only_its_own_consumer_on_its_own_jobs(connect, stream):
    operator = await connect("operator")
    thief = await connect("thief")
    victims = own_consumer(VICTIM)
    # The victim's consumer, or one of its own name filtered on the victim's jobs: refused.
    with pytest.raises(Exception):  # noqa: B017 - no answer comes: nats-py times out
        await thief.js.add_consumer(subjects.PREFILL_STREAM, victims, timeout=DENIED_S)
    own_name_victims_jobs = own_consumer(THIEF)
    own_name_victims_jobs.filter_subject = subjects.prefill_worker_jobs(VICTIM)
    with pytest.raises(Exception):  # noqa: B017
        await thief.js.add_consumer(
            subjects.PREFILL_STREAM, own_name_victims_jobs, timeout=DENIED_S
        )
    # Nor a consumer by the legacy subject, or an ephemeral one.
    legacy = own_consumer(THIEF)
    legacy.name = None
    legacy.filter_subject = subjects.prefill_worker_jobs(VICTIM)
    with pytest.raises(Exception):  # noqa: B017
        await thief.js.add_consumer(subjects.PREFILL_STREAM, legacy, timeout=DENIED_S)
    names = {info.name for info in await operator.js.consumers_info(subjects.PREFILL_STREAM)}
    assert names == set()
    # Its own, on its own jobs: made.
    await thief.js.add_consumer(subjects.PREFILL_STREAM, own_consumer(THIEF), timeout=3)
    names = {info.name for info in await operator.js.consumers_info(subjects.PREFILL_STREAM)}
    assert names == {own_consumer(THIEF).name}
    # And no worker may make, delete or purge the stream.
    with pytest.raises(Exception):  # noqa: B017
        await thief.js.delete_stream(subjects.PREFILL_STREAM)
    assert await operator.stream_exists(subjects.PREFILL_STREAM)


async def test_a_worker_cannot_take_jobs_from_another_workers_consumer(connect, stream):
    victim = await connect("victim")
    await victim.js.add_consumer(subjects.PREFILL_STREAM, own_consumer(VICTIM))
    gateway = await connect("gateway")
    job = pb.PrefillJob(request_id="r3", prompt_token_ids=PROMPT, gateway_id=GATEWAY_ID)
    await gateway.js_publish(subjects.prefill_worker_jobs(VICTIM), job)
    thief = await connect("thief")
    psub = await thief.js.pull_subscribe_bind(
        own_consumer(VICTIM).durable_name, subjects.PREFILL_STREAM
    )
    with pytest.raises(Exception):  # noqa: B017 - its pull request is refused: nothing comes
        await psub.fetch(1, timeout=DENIED_S)
    with pytest.raises(Exception):  # noqa: B017
        await thief.js.delete_consumer(subjects.PREFILL_STREAM, own_consumer(VICTIM).name)
    # The job still waits for its worker.
    mine = await victim.js.pull_subscribe_bind(
        own_consumer(VICTIM).durable_name, subjects.PREFILL_STREAM
    )
    msgs = await mine.fetch(1, timeout=3)
    assert pb.PrefillJob.FromString(msgs[0].data).request_id == "r3"
    await msgs[0].ack()


async def test_the_gateway_cannot_delete_or_purge_the_stream_and_remakes_a_lost_one(
    server, connect, stream
):
    operator = await connect("operator")
    gateway = await connect("gateway")
    await gateway.js_publish(subjects.prefill_worker_jobs(VICTIM), pb.PrefillJob(request_id="x"))
    for attempt in (gateway.js.delete_stream, gateway.js.purge_stream):
        with pytest.raises(Exception):  # noqa: B017 - no answer: nats-py times out
            await asyncio.wait_for(attempt(subjects.PREFILL_STREAM), DENIED_S * 3)
    info = await operator.js.stream_info(subjects.PREFILL_STREAM)
    assert info.state.messages == 1  # the job waits still
    # The gateway owns it: lost (here by the operator's hand), it is made again, and /ready
    # says why not meanwhile.
    settings = GatewaySettings(nats_url=USERS["gateway"].url(server), instance_id=GATEWAY_ID)
    backend = NatsBackend(settings)
    await backend.start()
    try:
        assert await backend.not_ready() is None
        await operator.js.delete_stream(subjects.PREFILL_STREAM)
        said = await backend.not_ready()
        assert said is not None and subjects.PREFILL_STREAM in said
        assert await settles(lambda: operator.stream_exists(subjects.PREFILL_STREAM), 10)
        assert await backend.not_ready() is None
    finally:
        await backend.stop()


# --- token chunks, a worker's own claims, and moved jobs --------------------------------------


@contextlib.asynccontextmanager
async def gateway_serving(server: str, connect, placement: pb.Placement) -> AsyncIterator:
    """A gateway (as its own user) and a router that places every request as `placement`."""
    router = await connect("router")

    async def on_route(_req: pb.RouteRequest, msg: Msg) -> None:
        await router.reply(msg, pb.RouteReply(placement=placement))

    await router.subscribe(subjects.ROUTER_ROUTE, pb.RouteRequest, on_route)
    await router.sync()
    settings = GatewaySettings(
        nats_url=USERS["gateway"].url(server),
        instance_id=GATEWAY_ID,
        idle_timeout_s=10,
        dead_worker_grace_s=30,
        prefill_redelivery_grace_s=30,
    )
    backend = NatsBackend(settings)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.stop()


@contextlib.asynccontextmanager
async def beating(bus: Bus, worker_id: str, max_model_len: int = 4096) -> AsyncIterator[None]:
    """`worker_id` sends heartbeats (10 a second) on its own subject until the block ends."""
    beat = pb.WorkerHeartbeat(
        worker_id=worker_id,
        role="prefill",
        model="m",
        max_model_len=max_model_len,
        heartbeat_interval_ms=100,
    )

    async def loop() -> None:
        while True:
            await bus.publish(subjects.heartbeat("prefill", worker_id), beat)
            await asyncio.sleep(0.1)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def text_chunk(index: int, text: str, *, finished: bool = False) -> pb.TokenChunk:
    return pb.TokenChunk(
        index=index,
        token_ids=[ord(c) for c in text],
        text=text,
        finished=finished,
        finish_reason="stop" if finished else "",
    )


async def test_a_worker_cannot_send_tokens_for_a_request_it_was_not_given(server, connect, stream):
    """The thief's password publishes chunks for the victim's request: in its own name they
    are ignored (it was not placed there), in the victim's name NATS refuses them."""
    placement = pb.Placement(prefill_worker_id=VICTIM, decode_worker_id=VICTIM)
    victim, thief = await connect("victim"), await connect("thief")
    async with gateway_serving(server, connect, placement) as backend:
        tokens = await backend.submit("r-victim", "m", PROMPT, pb.SamplingParams(max_tokens=2))
        as_itself = subjects.tokens(GATEWAY_ID, "r-victim", THIEF)
        await thief.publish(as_itself, text_chunk(0, "EVIL"))
        await thief.publish(as_itself, pb.TokenChunk(index=0, handed_to=THIEF))
        await thief.publish(as_itself, text_chunk(1, "!", finished=True))
        forged = subjects.tokens(GATEWAY_ID, "r-victim", VICTIM)
        await thief.publish(forged, text_chunk(0, "EVIL"))  # not its subject: refused
        await thief.publish(forged, text_chunk(1, "!", finished=True))
        await thief.sync()
        await asyncio.sleep(QUIET_S)
        assert not tokens.has_chunk()
        own = subjects.tokens(GATEWAY_ID, "r-victim", VICTIM)
        await victim.publish(own, text_chunk(0, "blue"))
        await victim.publish(own, text_chunk(4, ".", finished=True))  # after 4 tokens
        got = [c async for c in tokens]
        await tokens.close()
    assert "".join(c.text for c in got) == "blue." and {c.worker_id for c in got} == {VICTIM}


async def test_a_worker_claiming_a_tiny_context_does_not_shorten_the_gateways(
    server, connect, stream
):
    """The thief's own heartbeat says its context is 1 token: that is its business (the
    router gives it nothing longer), not everyone's limit."""
    victim, thief = await connect("victim"), await connect("thief")
    placement = pb.Placement(prefill_worker_id=VICTIM, decode_worker_id=VICTIM)
    async with (
        gateway_serving(server, connect, placement) as backend,
        beating(victim, VICTIM, 4096),
        beating(thief, THIEF, 1),
    ):
        assert await eventually(lambda: THIEF in backend.fleet and VICTIM in backend.fleet)
        await asyncio.sleep(QUIET_S)
        assert backend.fleet.max_model_len(asyncio.get_running_loop().time()) == 4096


async def test_the_router_cannot_move_a_live_workers_request_to_another(server, connect, stream):
    """With the router's password a move of the victim's job to the thief is announced while
    the victim lives: the gateway's own fleet view disagrees, so the thief's chunks stay out.
    Once the victim is dead, the same move is believed (the check is what stops it)."""
    placement = pb.Placement(prefill_worker_id=VICTIM, decode_worker_id=VICTIM)
    victim, thief, router = await connect("victim"), await connect("thief"), await connect("router")
    moved = pb.JobMoved(request_id="r-moved", from_worker_id=VICTIM, to_worker_id=THIEF)
    async with gateway_serving(server, connect, placement) as backend:
        tokens = await backend.submit("r-moved", "m", PROMPT, pb.SamplingParams(max_tokens=2))
        as_thief = subjects.tokens(GATEWAY_ID, "r-moved", THIEF)
        async with beating(thief, THIEF):
            async with beating(victim, VICTIM):
                assert await eventually(lambda: VICTIM in backend.fleet and THIEF in backend.fleet)
                await router.publish(subjects.moved(GATEWAY_ID, "r-moved"), moved)
                await thief.publish(as_thief, text_chunk(0, "EVIL"))
                await thief.sync()
                await asyncio.sleep(1.5)  # the stream rechecks waiting moves each second
                assert not tokens.has_chunk()
            # The victim falls silent: the move waiting in the gateway now holds.
            first = await asyncio.wait_for(anext(tokens), 10)
            assert first.text == "EVIL" and first.worker_id == THIEF
        await tokens.close()


# --- drains ------------------------------------------------------------------------------------


async def test_a_drain_over_nats_needs_the_stacks_control_token(launch_stack):
    """The telemetry user may publish drains, but its password alone drains nothing."""
    config = StackConfig(
        prefill=1,
        decode=0,
        engine="fake",
        gateway=False,
        kvcache=False,
        facilities=False,
        telemetry=False,
        worker_env={"TOKENYARD_WORKER_HEARTBEAT_INTERVAL_S": "0.3"},
    )
    with launch_stack(config) as stack:
        bus = await Bus.connect(stack.nats.url_for(auth.telemetry()), name="telemetry")
        try:
            (worker,) = stack.workers
            request = pb.DrainRequest(worker_id=worker.name, reason="an insider")

            async def drain(headers: dict[str, str] | None) -> pb.DrainReply:
                return await bus.request(
                    subjects.drain(worker.name), request, pb.DrainReply, timeout=5, headers=headers
                )

            assert await settles(lambda: _answers(drain), 120), "the worker never answered"
            for headers in (None, auth.control_headers("a guess")):
                refused = await drain(headers)
                assert not refused.accepted and "operator's token" in refused.message
            assert worker.alive()
            accepted = await drain(auth.control_headers(stack.grpc_token))
            assert accepted.accepted and "draining" in accepted.message
        finally:
            await bus.close()


async def _answers(drain: Callable[[dict[str, str] | None], Awaitable[pb.DrainReply]]) -> bool:
    try:
        await drain(None)
    except Exception:  # not subscribed yet: no responders, or a timeout
        return False
    return True
