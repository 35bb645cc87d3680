"""docker-compose.yml, validated by compose itself, then run and served through.

No container engine runs here, so the compose file's service graph runs as host processes
with the environment compose gives each container (tests/e2e/compose_hosts.py says how
addresses and volumes are mapped), and a chat completion goes through the gateway. NATS
runs with the compose file's users (infra/nats/users.conf, passwords as `.env` would give
them), so every service, the telemetry console included, speaks as its own user.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest
from compose_hosts import HOST_SERVICES, ComposeHosts, accepts, compose_config

import infra

pytestmark = pytest.mark.slow

# The compose file's router splits every request between the prefill and the decode
# container (TOKENYARD_ROUTER_DISAGGREGATION: always); a long prompt makes the KV pull visible.
# The services whose spans the console must show for a request split between the pools.
SPAN_SOURCES = {"gateway", "router", "worker-prefill", "worker-decode"}
PROMPT = "List the planets of the solar system in order, with one fact about each. " * 20


@pytest.fixture(scope="module")
def compose(tmp_path_factory):
    for name, port in HOST_SERVICES.items():  # the compose graph's Redis and PostgreSQL
        if not accepts("127.0.0.1", port):
            infra.missing(name, f"the compose test uses the host's own, on 127.0.0.1:{port}")
    hosts = ComposeHosts(compose_config(), log_dir=tmp_path_factory.mktemp("compose-logs"))
    try:
        hosts.start(timeout=420)
        for name in ("gateway", "prefill", "decode", "facilities", "telemetry"):
            hosts.wait_for(hosts.services[name], "service_healthy", 300)
        yield hosts
    finally:
        hosts.stop()


def _post(url: str, body: dict, tries: int = 3) -> tuple[dict, str]:
    """POST as an OpenAI client would: a 503 means "retry after Retry-After seconds" (on
    this shared 2-core machine, the first request can find the router still busy)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(request, timeout=180) as resp:
                return json.loads(resp.read()), resp.headers["x-request-id"]
        except urllib.error.HTTPError as exc:
            detail = f"{exc.code}: {exc.read().decode()}"
            if exc.code != 503 or attempt == tries - 1:
                raise AssertionError(detail) from exc
            print(f"retrying after {detail}")
            time.sleep(float(exc.headers.get("Retry-After", "1")))
    raise AssertionError("unreachable")


def test_a_request_goes_through_the_compose_graph(compose):
    gateway = compose.services["gateway"]
    port = gateway.spec["ports"][0]["target"]
    base = f"http://{gateway.address}:{port}"
    with urllib.request.urlopen(f"{base}/ready", timeout=5) as resp:
        ready = json.loads(resp.read())
    assert {w["role"] for w in ready["workers"]} >= {"prefill", "decode"}, ready

    with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    answer, request_id = _post(
        f"{base}/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8},
    )
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] == 8

    prefill = compose.services["prefill"].address
    # The workers advertise their own address, never 0.0.0.0...
    assert f"KV endpoint '{prefill}:" in _log(compose, "prefill", "KV endpoint")
    # ...the prefill worker wrote the prompt's blocks through to the KV-cache service (in
    # the background, after the answer)...
    stored = re.findall(
        r"KV-cache offload of \S+: (\d+) blocks stored", _log(compose, "prefill", "offload of")
    )
    assert stored and int(stored[0]) >= 1
    # ...and the decode worker pulled the rest over the network (no shared /dev/shm).
    pulls = re.findall(
        r"KV pull \S+: \d+ blocks, [\d.]+ MB via (\w+)", _log(compose, "decode", "KV pull")
    )
    assert pulls and set(pulls) <= {"mooncake", "grpc"}

    # The console saw the request's spans from the gateway and both pools (over NATS, as
    # the telemetry user, from services each with their own user).
    trace = _trace(compose, request_id)
    assert {s["service"] for s in trace["spans"]} >= SPAN_SOURCES


def test_nats_refuses_a_connection_without_a_user(compose):
    import asyncio

    from tokenyard.bus.nats import Bus, BusError

    nats = compose.services["nats"]

    async def anonymous() -> None:
        await Bus.connect(f"nats://{nats.address}:4222", name="stranger", first_connect_timeout=3)

    with pytest.raises(BusError, match="cannot connect"):
        asyncio.run(anonymous())


def _trace(compose: ComposeHosts, request_id: str, timeout: float = 60) -> dict:
    telemetry = compose.services["telemetry"]
    port = telemetry.spec["ports"][0]["target"]
    url = f"http://{telemetry.address}:{port}/api/requests/{request_id}/trace"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                trace = json.loads(resp.read())
            services = {s["service"] for s in trace["spans"]}
            if services >= SPAN_SOURCES or time.monotonic() > deadline:
                return trace
        except urllib.error.HTTPError as exc:
            if exc.code != 404 or time.monotonic() > deadline:
                raise
        time.sleep(1)


def _log(compose: ComposeHosts, service: str, wanted: str, timeout: float = 20) -> str:
    """The service's log once it holds ``wanted`` (or at the timeout)."""
    path = compose.log_dir / f"{service}.log"
    deadline = time.monotonic() + timeout
    while wanted not in path.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    return path.read_text()
