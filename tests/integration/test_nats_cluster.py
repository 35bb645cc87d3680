"""The Kubernetes NATS configuration, run for real: three nats-servers from the ConfigMap's
nats.conf (addresses and folders made local), the prefill work queue with 3 replicas, and a
job still accepted and kept after one node dies."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from kustomize_render import render

from tokenyard.bus import auth, subjects
from tokenyard.bus.embedded import free_port, nats_server_binary
from tokenyard.bus.nats import Bus
from tokenyard.v1 import serving_pb2 as pb

K8S_BASE = Path(__file__).resolve().parents[2] / "infra" / "k8s" / "base"
NODES = 3


def local_conf(conf: str, node: int, ports: list[dict[str, int]], folder: Path) -> str:
    """The ConfigMap's nats.conf with this machine's addresses, ports and folders."""
    mine = ports[node]
    conf = conf.replace("0.0.0.0:4222", f"127.0.0.1:{mine['client']}")
    conf = conf.replace("0.0.0.0:8222", f"127.0.0.1:{mine['http']}")
    conf = conf.replace("0.0.0.0:6222", f"127.0.0.1:{mine['cluster']}")
    conf = conf.replace("/var/run/nats/nats.pid", str(folder / "nats.pid"))
    conf = conf.replace("store_dir: /data", f"store_dir: {folder / 'js'}")
    return re.sub(
        r"nats://nats-(\d)\.nats-headless:6222",
        lambda m: f"nats://127.0.0.1:{ports[int(m.group(1))]['cluster']}",
        conf,
    )


# Secret `tokenyard-nats` as the pods get it: every deployment user's password.
PASSWORDS = {auth.password_variable(u.name): auth.new_password() for u in auth.deployment_users()}


@pytest.fixture
def cluster(tmp_path):
    docs = render(K8S_BASE)
    conf = next(d for d in docs if d["metadata"]["name"] == "nats-config")["data"]["nats.conf"]
    users = next(d for d in docs if d["metadata"]["name"] == "nats-users")["data"]["users.conf"]
    ports = [{k: free_port() for k in ("client", "http", "cluster")} for _ in range(NODES)]
    procs = []
    for node in range(NODES):
        folder = tmp_path / f"nats-{node}"
        folder.mkdir()
        (folder / "nats.conf").write_text(local_conf(conf, node, ports, folder))
        (folder / "users.conf").write_text(users)  # the projected ConfigMap beside it
        env = {**os.environ, **PASSWORDS, "POD_NAME": f"nats-{node}"}
        procs.append(
            subprocess.Popen(
                [nats_server_binary(), "-c", str(folder / "nats.conf")],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(folder / "log", "wb"),  # noqa: SIM115 - the child owns it
            )
        )
    try:
        operator = auth.NatsUser(
            "operator", [], [], password=PASSWORDS[auth.password_variable("operator")]
        )
        yield [operator.url(f"nats://127.0.0.1:{p['client']}") for p in ports], procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


async def connect_when_clustered(url: str, timeout: float = 60) -> Bus:
    """Connect, then wait until the cluster has a JetStream meta leader."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            bus = await Bus.connect(url, name="cluster-test")
            await bus.js.account_info()
            return bus
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def test_work_queue_with_three_replicas_survives_a_node(cluster):
    urls, procs = cluster
    bus = await connect_when_clustered(urls[0])
    try:
        await bus.ensure_work_queue(
            subjects.PREFILL_STREAM,
            [subjects.PREFILL_JOBS, f"{subjects.PREFILL_JOBS}.>"],
            replicas=3,
        )
        info = await bus.js.stream_info(subjects.PREFILL_STREAM)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == NODES - 1

        procs[2].kill()  # node 0 stays: our connection is there
        procs[2].wait()
        job = pb.PrefillJob(request_id="r-1", prompt_token_ids=[1, 2, 3])
        deadline = time.monotonic() + 30
        while True:  # a new stream leader may take a moment if the dead node led it
            try:
                await bus.js_publish(subjects.prefill_worker_jobs("w1"), job, msg_id="r-1")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        info = await bus.js.stream_info(subjects.PREFILL_STREAM)
        assert info.state.messages == 1
    finally:
        await bus.close()
