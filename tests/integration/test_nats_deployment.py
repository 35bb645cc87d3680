"""The deployment's NATS users (infra/nats/users.conf, as compose and Kubernetes run it) on
a real nats-server: passwords from the environment, pools of workers under one user each,
and `tokenyard up --nats-url` serving against it, with credentials in the URL or per
service from the environment."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_client import Request, connect, wait_disaggregated, wait_router

import infra
from tokenyard.bus import auth, subjects
from tokenyard.bus.embedded import nats_server_binary
from tokenyard.bus.nats import Bus, BusError
from tokenyard.services.launch.procs import ChildProcess, wait_until
from tokenyard.services.launch.stack import StackConfig
from tokenyard.v1 import serving_pb2 as pb

USERS_CONF = Path(__file__).resolve().parents[2] / "infra" / "nats" / "users.conf"
PASSWORDS = {auth.password_variable(u.name): auth.new_password() for u in auth.deployment_users()}
PROMPT = list(range(1, 40))


def as_user(server: str, name: str) -> str:
    return auth.NatsUser(name, [], [], password=PASSWORDS[auth.password_variable(name)]).url(server)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("nats-deployment")
    argv = ["-c", str(USERS_CONF)]
    with infra.nats_with_users([], folder, argv=argv, env=PASSWORDS) as url:
        yield url


def test_without_its_passwords_the_server_does_not_start(tmp_path):
    argv = [nats_server_binary(), "-c", str(USERS_CONF), "-t"]
    proc = ChildProcess("nats", argv, env={}, log_path=tmp_path / "log").start()
    assert wait_until(lambda: not proc.alive(), 10)
    assert "TOKENYARD_NATS_OPERATOR_PASSWORD" in proc.log_tail()


async def test_anonymous_is_refused_and_a_pool_speaks_for_its_role_only(server):
    with pytest.raises(BusError, match="cannot connect"):
        await Bus.connect(server, name="stranger", first_connect_timeout=3)
    operator = await Bus.connect(as_user(server, "operator"), name="op")
    decode = await Bus.connect(as_user(server, "decode"), name="decode")
    seen: list[str] = []

    async def on(_message: pb.WorkerHeartbeat, msg) -> None:
        seen.append(msg.subject)

    try:
        await operator.subscribe(f"{subjects.PREFIX}.>", pb.WorkerHeartbeat, on)
        await operator.sync()
        # Any decode worker's heartbeat (replicas are named at start); no prefill one, no
        # rack state.
        await decode.publish(subjects.heartbeat("decode", "web-7f9-1"), pb.WorkerHeartbeat())
        await decode.publish(subjects.heartbeat("prefill", "web-7f9-1"), pb.WorkerHeartbeat())
        await decode.publish(subjects.facilities_state("rack-a"), pb.WorkerHeartbeat())
        await decode.sync()
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert seen == [subjects.heartbeat("decode", "web-7f9-1")]
    finally:
        await decode.close()
        await operator.close()


def stack_config(nats_url: str) -> StackConfig:
    return StackConfig(
        nats_url=nats_url,
        engine="fake",
        gateway=False,
        kvcache=False,
        facilities=False,
        telemetry=False,
        router_env={"TOKENYARD_ROUTER_DISAGGREGATION": "always"},
        worker_env={"TOKENYARD_WORKER_FAKE_STEP_S": "0.005"},
    )


@pytest.mark.slow
@pytest.mark.parametrize("credentials", ["in the URL", "per service from the environment"])
async def test_tokenyard_up_serves_against_the_deployments_nats(
    server, credentials, launch_stack, monkeypatch
):
    if credentials == "in the URL":
        url = as_user(server, "operator")
    else:
        url = server
        for name, password in PASSWORDS.items():
            monkeypatch.setenv(name, password)
    with launch_stack(stack_config(url)) as stack:
        router_url = stack.procs[0].env["TOKENYARD_ROUTER_NATS_URL"]
        worker_urls = {w.env["TOKENYARD_WORKER_NATS_URL"] for w in stack.workers}
        if credentials == "in the URL":
            assert router_url == url and worker_urls == {url}
        else:
            assert router_url == as_user(server, "router")
            assert worker_urls == {as_user(server, "prefill"), as_user(server, "decode")}
        bus = await connect(stack.nats_url)
        try:
            await wait_router(bus, placeable=True)
            await wait_disaggregated(bus, PROMPT)
            request = Request(bus, PROMPT, pb.SamplingParams(max_tokens=6))
            reply = await request.submit()
            assert reply.placement.disaggregated
            result = await request.wait(30)
            assert len(result.token_ids) == 6
        finally:
            await bus.close()
