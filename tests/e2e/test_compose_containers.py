"""docker-compose.yml run for real, in containers: the images of `make images`, `up` with
the healthchecks, a streamed chat through the gateway container, decode scaled to two
replicas with requests placed on both, a decode container's process killed mid-stream (the
stream finishes, the container comes back), and `down -v` leaving nothing behind.

Compose v2 (`docker compose`) where the docker CLI has it, else Debian's docker-compose (v1).
The tests run in file order and share one compose project. Without an engine they skip;
with TOKENYARD_REQUIRE_CONTAINERS=1 (CI) they fail instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from compose_hosts import COMPOSE_FILE, NATS_PASSWORDS, ROOT, image_environment
from prometheus_client.parser import text_string_to_metric_families

import infra
from tokenyard.bus.embedded import free_port

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(3600)]

PROJECT = f"tokenyard-test-{os.getpid()}"
BUILD_TIMEOUT_S = 1800
HEALTHY_TIMEOUT_S = 600
WORKER_OPS_PORT = 8092  # the compose file's TOKENYARD_WORKER_OPS_PORT
PROMPT = "Write a short story about a lighthouse keeper and a storm."
STREAM_TOKENS = 160  # long enough to kill a decode container in the middle of it
KILL_AFTER_CHUNKS = 8


def compose_command() -> list[str]:
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    return ["docker", "compose"] if v2.returncode == 0 else ["docker-compose"]


class Project:
    """One compose project of the repository's file, and the engine's view of it."""

    def __init__(self, env: dict[str, str]) -> None:
        import docker

        self.env = env
        self.command = [*compose_command(), "-f", str(COMPOSE_FILE), "-p", PROJECT]
        self.engine = docker.from_env()

    def run(self, *args: str, timeout: float = 900) -> str:
        result = subprocess.run(
            [*self.command, *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert result.returncode == 0, f"compose {' '.join(args)}:\n{result.stderr[-4000:]}"
        return result.stdout

    def containers(self, service: str | None = None) -> list:
        labels = [f"com.docker.compose.project={PROJECT}"]
        if service:
            labels.append(f"com.docker.compose.service={service}")
        return self.engine.containers.list(all=True, filters={"label": labels})

    def wait_healthy(self, timeout: float = HEALTHY_TIMEOUT_S) -> None:
        """Every container running, and healthy where it has a healthcheck."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [c.name for c in self.containers() if _state(c) not in ("healthy", "running")]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy after {timeout} s: {pending}\n{self.logs()}")
            time.sleep(3)

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "30", timeout=120)[-8000:]

    def address(self, container) -> str:
        container.reload()
        networks = container.attrs["NetworkSettings"]["Networks"]
        return next(iter(networks.values()))["IPAddress"]


def _state(container) -> str:
    container.reload()
    state = container.attrs["State"]
    return state.get("Health", {}).get("Status") or state["Status"]


@pytest.fixture(scope="module")
def project() -> Iterator[Project]:
    if not (infra.require_containers() or os.environ.get("TOKENYARD_COMPOSE_TEST") == "1"):
        pytest.skip(
            "the compose test builds every image and runs the stack in containers (many "
            "minutes): TOKENYARD_COMPOSE_TEST=1, or TOKENYARD_CI_CONTAINERS=1 for .ci/run"
        )
    if not infra.container_engine():
        infra.missing_engine("the compose test runs the stack in containers")
    env = {**image_environment(), **NATS_PASSWORDS, **_published_ports()}
    started = time.monotonic()
    build = subprocess.run(
        ["bash", "scripts/build-images.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    print(f"make images: {time.monotonic() - started:.0f} s")
    env |= _images_env()
    project = Project(env)
    try:
        started = time.monotonic()
        project.run("up", "-d", "--no-build")
        project.wait_healthy()
        print(f"compose up, healthy: {time.monotonic() - started:.0f} s")
        yield project
    finally:
        project.run("down", "-v", "--remove-orphans", timeout=300)


def _published_ports() -> dict[str, str]:
    """Free host ports: the machine may already serve the compose file's defaults."""
    services = ("GATEWAY", "FACILITIES", "TELEMETRY", "PROMETHEUS", "GRAFANA")
    return {f"TOKENYARD_PUBLISH_{s}_PORT": str(free_port()) for s in services}


def _images_env() -> dict[str, str]:
    path = ROOT / "build" / "images.env"
    lines = path.read_text().splitlines() if path.exists() else []
    pairs = (line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    return dict(pairs)


def gateway_url(project: Project) -> str:
    return f"http://127.0.0.1:{project.env['TOKENYARD_PUBLISH_GATEWAY_PORT']}"


def stream_chat(project: Project, on_chunk=None, max_tokens: int = 16) -> tuple[str, str]:
    """A streamed chat completion through the gateway container: (text, finish reason).
    ``on_chunk(n)`` is called after the n-th content chunk."""
    body = {
        "model": _model(project),
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    text, finish, chunks, done = "", "", 0, False
    url = f"{gateway_url(project)}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            if content := choice["delta"].get("content"):
                text += content
                chunks += 1
                if on_chunk:
                    on_chunk(chunks)
            finish = choice.get("finish_reason") or finish
    assert done, f"the stream ended without [DONE] after {chunks} chunks"
    return text, finish


def _model(project: Project) -> str:
    response = httpx.get(f"{gateway_url(project)}/v1/models", timeout=10)
    return response.json()["data"][0]["id"]


def decode_workers_ready(project: Project) -> int:
    try:
        ready = httpx.get(f"{gateway_url(project)}/ready", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return 0
    return sum(1 for w in ready.get("workers", []) if w["role"] == "decode")


def wait_decode_workers(project: Project, count: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while decode_workers_ready(project) != count:
        assert time.monotonic() < deadline, f"the gateway never saw {count} decode workers"
        time.sleep(2)


def worker_metric(project: Project, container, name: str) -> float:
    """The sum of one metric's samples on a worker container's ops server."""
    url = f"http://{project.address(container)}:{WORKER_OPS_PORT}/metrics"
    text = httpx.get(url, timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
        if not sample.name.endswith("_created")
    )


def test_every_container_comes_up_healthy(project):
    services = {c.labels["com.docker.compose.service"]: _state(c) for c in project.containers()}
    tokenyard = ("router", "kvcache", "prefill", "decode", "facilities", "gateway", "telemetry")
    assert set(services) == {"nats", "redis", "postgres", *tokenyard}  # no profile's
    assert set(services.values()) == {"healthy"}, services


def test_a_streamed_chat_through_the_gateway_container(project):
    text, finish = stream_chat(project, max_tokens=16)
    assert text.strip()
    assert finish == "length"


def test_decode_scaled_to_two_takes_requests_on_both(project):
    project.run("up", "-d", "--no-build", "--no-recreate", "--scale", "decode=2")
    project.wait_healthy()
    decodes = project.containers("decode")
    assert len(decodes) == 2
    wait_decode_workers(project, 2)
    name = "tokenyard:request_success"
    before = [worker_metric(project, c, name) for c in decodes]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: stream_chat(project, max_tokens=24), range(8)))
    assert all(finish == "length" for _, finish in answers)
    served = [worker_metric(project, c, name) - b for c, b in zip(decodes, before, strict=True)]
    assert sum(served) == 8 and min(served) >= 1, served


def test_prometheus_scrapes_every_service_and_a_dashboard_query_has_data(project):
    """Prometheus of the observability profile alone (Grafana and the OTel collector have
    no image without Docker Hub: docs/deploy.md): every service's target up, both decode
    replicas among them, and the dashboard's first panel query answering with data."""
    project.run("up", "-d", "--no-build", "--no-deps", "prometheus")
    project.wait_healthy()
    base = f"http://127.0.0.1:{project.env['TOKENYARD_PUBLISH_PROMETHEUS_PORT']}"
    deadline = time.monotonic() + 120
    while True:
        targets = httpx.get(f"{base}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        health: dict[str, list[str]] = {}
        for target in targets:
            health.setdefault(target["labels"]["job"], []).append(target["health"])
        # The span metrics come from the collector, which is not running here.
        health.pop("otel-collector-spanmetrics", None)
        if all(h == ["up"] * len(h) for h in health.values()) and len(health["decode"]) == 2:
            break
        assert time.monotonic() < deadline, health
        time.sleep(3)
    assert set(health) == {
        "gateway",
        "router",
        "prefill",
        "decode",
        "kvcache",
        "facilities",
        "telemetry",
    }

    dashboard = json.loads((ROOT / "infra/grafana/dashboards/tokenyard.json").read_text())
    expr = dashboard["panels"][0]["targets"][0]["expr"]
    query = expr.replace("$model", ".*").replace("$__rate_interval", "5m")
    result = httpx.get(f"{base}/api/v1/query", params={"query": query}, timeout=5).json()
    assert result["status"] == "success" and result["data"]["result"], (query, result)


def test_a_decode_container_killed_mid_stream(project):
    """SIGKILL to a decode container's process, from the host (as the OOM killer would):
    the gateway resumes the stream on the other decode, and the engine restarts the dead
    container (restart: unless-stopped)."""
    wait_decode_workers(project, 2)
    reference, _ = stream_chat(project, max_tokens=STREAM_TOKENS)
    killed: list = []

    def kill_the_busy_decode(chunks: int) -> None:
        if chunks != KILL_AFTER_CHUNKS:
            return
        busy = [
            c
            for c in project.containers("decode")
            if worker_metric(project, c, "tokenyard:num_requests_running") > 0
        ]
        assert len(busy) == 1, "no decode container holds the stream"
        victim = busy[0]
        victim.reload()
        killed.append((victim, victim.attrs["RestartCount"]))
        os.kill(victim.attrs["State"]["Pid"], signal.SIGKILL)

    text, finish = stream_chat(project, kill_the_busy_decode, max_tokens=STREAM_TOKENS)
    assert killed, "the stream finished before the kill"
    # Greedy: the resumed answer is the answer the stream would have given unharmed.
    assert (text, finish) == (reference, "length")

    victim, restarts = killed[0]
    deadline = time.monotonic() + HEALTHY_TIMEOUT_S
    while victim.attrs["RestartCount"] == restarts:
        assert time.monotonic() < deadline, "the killed container was not restarted"
        time.sleep(1)
        victim.reload()
    project.wait_healthy()
    wait_decode_workers(project, 2)


def test_down_removes_every_container_network_and_volume(project):
    project.run("down", "-v", "--remove-orphans", timeout=300)
    label = {"label": [f"com.docker.compose.project={PROJECT}"]}
    assert project.containers() == []
    assert project.engine.networks.list(filters=label) == []
    assert project.engine.volumes.list(filters=label) == []
