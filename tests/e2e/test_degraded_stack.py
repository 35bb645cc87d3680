"""A local stack that loses parts of itself: what keeps serving and what /ready says.

One stack (fake engine, one aggregated worker on rack-a, the KV-cache service, facilities
with a short dwell, API keys with per-minute limits in the stack's own Redis), driven
through its supervisor as `tokenyard up` drives it:

- Redis killed: a limited key gets a clear 503 (not a 500) and /ready says why; the
  supervisor restarts it and the key is served again;
- every rack drained by a pump failure: /ready is 503 and names the rack; after the fault
  is cleared it is ready again once the facilities dwell has passed;
- the KV-cache service killed again and again: left down, named in /ready's
  optional_services, and the stack still serves.

And `kill -9` of a launcher leaves none of its children (Redis included) running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tokenyard.bus.embedded import free_port
from tokenyard.services.gateway.keys import KeyStore
from tokenyard.services.launch.procs import wait_until
from tokenyard.services.launch.stack import LocalStack, StackConfig
from tokenyard.services.launch.supervise import RestartPolicy

pytestmark = pytest.mark.slow

DWELL_S = 3.0
FAKE_MODEL = "fake-model"  # what the fake engine's workers serve


@pytest.fixture(scope="module")
def keys_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('keys') / 'keys.db'}"


@pytest.fixture(scope="module")
def stack(keys_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    config = StackConfig(
        port=free_port(),
        aggregated=True,
        engine="fake",
        telemetry=False,
        keys_db_url=keys_db,
        log_dir=tmp_path_factory.mktemp("logs"),
        facilities_env={"TOKENYARD_FACILITIES_DWELL_S": str(DWELL_S)},
        worker_env={"TOKENYARD_WORKER_HEARTBEAT_INTERVAL_S": "0.5"},
        restart_policy=RestartPolicy(first_backoff_s=0.2, max_fast_failures=2),
    )
    with LocalStack(config) as s:
        # NOTE: not wait_ready(): it reads /v1/models, which asks for a key here.
        assert wait_until(lambda: (body := s.ready()) and s.all_workers_registered(body), 300)
        yield s


@pytest.fixture(scope="module")
def key(keys_db: str) -> str:
    secret, _ = KeyStore.open(keys_db).create("limited", requests_per_minute=1000)
    return secret


def chat(stack: LocalStack, key: str) -> httpx.Response:
    body = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(
        f"{stack.gateway_url}/v1/chat/completions", json=body, headers=headers, timeout=30
    )


def ready(stack: LocalStack) -> httpx.Response:
    return httpx.get(f"{stack.gateway_url}/ready", timeout=5)


def supervised_until(stack: LocalStack, predicate, timeout: float) -> bool:
    """Poll the supervisor (as `tokenyard up` does) until ``predicate()`` holds."""

    def step() -> bool:
        stack.supervise()
        return bool(predicate())

    return wait_until(step, timeout, interval=0.2)


def test_redis_down_is_a_clear_503_and_it_is_restarted(stack: LocalStack, key: str):
    assert chat(stack, key).status_code == 200
    assert stack.redis is not None
    first = stack.redis.pid
    stack.redis.kill()

    r = chat(stack, key)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "rate_limit_store_unavailable"
    assert r.headers["retry-after"] == "1"
    not_ready = ready(stack)
    assert not_ready.status_code == 503
    assert "rate limit store (Redis) does not answer" in not_ready.json()["reason"]

    assert supervised_until(stack, lambda: stack.redis.alive(), 10)
    assert stack.redis.pid != first
    assert stack.supervisor.records["redis"].restarts == 1
    assert wait_until(lambda: chat(stack, key).status_code == 200, 10)
    assert ready(stack).status_code == 200


def facilities(stack: LocalStack, method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {stack.facilities_admin_token}"}
    url = f"{stack.facilities_url}/v1/admin/racks/{path}"
    r = httpx.request(method, url, headers=headers, timeout=5, **kwargs)
    r.raise_for_status()
    return r


def test_every_rack_drained_is_not_ready_until_the_dwell_after_the_clear(
    stack: LocalStack, key: str
):
    facilities(stack, "POST", "rack-a/faults", json={"kind": "pump_failure"})
    assert supervised_until(stack, lambda: ready(stack).status_code == 503, 20)
    reason = ready(stack).json()["reason"]
    assert "every prefill worker's rack is drained" in reason and "rack rack-a" in reason
    refused = chat(stack, key)
    assert refused.status_code == 503 and refused.json()["error"]["message"]

    facilities(stack, "DELETE", "rack-a/faults")
    cleared = time.monotonic()
    assert supervised_until(stack, lambda: ready(stack).status_code == 200, DWELL_S + 15)
    waited = time.monotonic() - cleared
    print(f"ready {waited:.1f} s after the clear (dwell {DWELL_S} s)")
    assert waited >= DWELL_S - 0.5  # the rack relaxes only after the dwell
    assert chat(stack, key).status_code == 200


def test_a_crashing_kvcache_is_left_down_and_the_stack_serves(stack: LocalStack, key: str):
    kvcache = next(p for p in stack.procs if p.name == "kvcache")
    for _ in range(3):  # max_fast_failures=2: the third fast death is given up on
        assert supervised_until(stack, kvcache.alive, 10)
        kvcache.kill()
    assert supervised_until(stack, lambda: "kvcache" in stack.down, 10)
    assert "kvcache failed 3 times in a row" in stack.down["kvcache"]
    assert not kvcache.alive()

    stack.check_alive()  # the rest is up, and a given-up optional service is no failure
    assert chat(stack, key).status_code == 200
    body = ready(stack).json()
    assert body["ready"] is True
    assert body["optional_services"]["kvcache"].startswith("down:")
    assert body["optional_services"]["facilities"] == "up"


LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from tokenyard.bus.embedded import free_port
    from tokenyard.services.launch.stack import LocalStack, StackConfig

    config = StackConfig(
        port=free_port(), aggregated=True, engine="fake", kvcache=False,
        facilities=False, telemetry=False, keys_db_url=sys.argv[1],
    )
    stack = LocalStack(config).start()
    print(" ".join(str(p.pid) for p in stack.procs), flush=True)
    time.sleep(600)
    """
)


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited: only its parent (here: none) has yet to reap it.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_kill_9_of_the_launcher_leaves_no_child_running(keys_db: str):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, keys_db], stdout=subprocess.PIPE, text=True
    )
    try:
        assert launcher.stdout is not None
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        names = Path(f"/proc/{pids[-1]}/cmdline").read_bytes()
        assert len(pids) == 5 and b"tokenyard.services.gateway" in names  # nats .. gateway
        redis_pid = next(
            pid for pid in pids if b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
        )
        assert running(redis_pid)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    assert wait_until(lambda: not any(running(pid) for pid in pids), 15), [
        pid for pid in pids if running(pid)
    ]
