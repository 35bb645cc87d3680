"""docker-compose.yml and infra/k8s/base say the same of each Tokenyard service: its image,
command, ports, probes and environment. Where they differ on purpose, the difference is
listed below with its reason; any other difference fails.

A variable set on one side only agrees when its value is the setting's default (the other
side gets the same value by leaving it out)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from compose_hosts import compose_config
from kustomize_render import render
from service_settings import SETTINGS

K8S_BASE = Path(__file__).resolve().parents[2] / "infra" / "k8s" / "base"
SERVICES = ("router", "kvcache", "prefill", "decode", "facilities", "gateway", "telemetry")

# Set in the manifests only, and why.
ONLY_K8S = {
    "NATS_PASSWORD": "the Secret's key, interpolated into the NATS URL as $(NATS_PASSWORD)",
    "TOKENYARD_WORKER_WORKER_ID": "the pod's name; a compose replica names itself hostname-pid",
    "TOKENYARD_WORKER_ADVERTISE_HOST": "the pod's IP; a container derives its own address",
    "TOKENYARD_GATEWAY_JETSTREAM_REPLICAS": "a 3-node NATS cluster; compose runs one server",
    "TOKENYARD_WORKER_JETSTREAM_REPLICAS": "a 3-node NATS cluster; compose runs one server",
    "TOKENYARD_WORKER_KV_PORT": "fixed, for the pod's port list and NetworkPolicy; any port here",
    "TOKENYARD_WORKER_CONTROL_PORT": "fixed, for the pod's port list and NetworkPolicy; any here",
    "TOKENYARD_KVCACHE_RAM_BYTES": "sized for a cluster node; compose keeps the default",
    "TOKENYARD_FACILITIES_SCALER_PORT": "KEDA's external scaler; compose polls the HTTP route",
    "TOKENYARD_KVCACHE_REDIS_BYTES": "sized for the cluster's Redis (maxmemory 3gb)",
    "TOKENYARD_FACILITIES_DATA_DIR": "a volume of the pod; compose keeps the state in PostgreSQL",
    "TOKENYARD_TELEMETRY_DATA_DIR": "a volume of the pod; compose keeps the state in PostgreSQL",
}
# Set in the compose file only, and why.
ONLY_COMPOSE = {
    "TOKENYARD_ROUTER_DISAGGREGATION": "one prefill and one decode container: split every request",
    "TOKENYARD_WORKER_KV_CACHE_BYTES": "512 MiB on a laptop; a pod sizes it from its memory limit",
    "TOKENYARD_KVCACHE_DISK_DIR": "a named volume; the pod's KV cache stays in RAM and Redis",
}
# Probes: compose has one healthcheck, Kubernetes a readiness and a liveness probe; the
# healthcheck is one of them.


@pytest.fixture(scope="module")
def compose() -> dict:
    return compose_config()["services"]


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    """The Tokenyard container of each Deployment, by service name."""
    deployments = {d["metadata"]["name"]: d for d in render(K8S_BASE) if d["kind"] == "Deployment"}
    return {
        name: next(c for c in deployments[name]["spec"]["template"]["spec"]["containers"])
        for name in SERVICES
    }


@pytest.mark.parametrize("service", SERVICES)
def test_image_and_command_agree(service, compose, k8s):
    # The same image; the tag is each deployment's own (a local build, a registry's).
    assert compose[service]["image"].split(":")[0] == k8s[service]["image"].split(":")[0]
    assert compose[service]["command"] == k8s[service]["command"]
    assert "args" not in k8s[service]


@pytest.mark.parametrize("service", SERVICES)
def test_every_port_the_service_listens_on_is_declared(service, compose, k8s):
    declared = {p["containerPort"] for p in k8s[service]["ports"]}
    env = compose[service]["environment"]
    listening = {int(v) for k, v in env.items() if k.endswith("_PORT") and v}
    published = {int(p["target"]) for p in compose[service].get("ports", [])}
    assert listening | published <= declared, (listening | published) - declared


@pytest.mark.parametrize("service", SERVICES)
def test_the_healthcheck_is_one_of_the_probes(service, compose, k8s):
    container = k8s[service]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probes = {
        (ports[probe["httpGet"]["port"]], probe["httpGet"]["path"])
        for key, probe in container.items()
        if key.endswith("Probe")
    }
    test = " ".join(compose[service]["healthcheck"]["test"])
    port, path = re.search(r"http://localhost:(\d+)(/\w+)", test).groups()
    assert (int(port), path) in probes, probes


@pytest.mark.parametrize("service", SERVICES)
def test_the_environment_agrees(service, compose, k8s):
    ours = {
        k: v
        for k, v in compose[service]["environment"].items()
        if k != "OTEL_EXPORTER_OTLP_ENDPOINT"
    }
    theirs = {e["name"]: e for e in k8s[service].get("env", [])}
    for name in ours.keys() & theirs.keys():
        if "valueFrom" in theirs[name]:
            continue  # a Secret's value there, the operator's .env here
        assert _normal(ours[name]) == _normal(theirs[name]["value"]), name
    for name in theirs.keys() - ours.keys():
        if name not in ONLY_K8S:
            assert "value" in theirs[name], f"{name} is set from a Secret in Kubernetes only"
            assert _is_default(name, theirs[name]["value"]), f"{name}: Kubernetes only"
    for name in ours.keys() - theirs.keys():
        if name not in ONLY_COMPOSE:
            assert _is_default(name, ours[name]), f"{name}: compose only"


def test_every_listed_difference_is_still_one(compose, k8s):
    """The lists above shrink when the two files come to agree."""
    ours = {k for s in SERVICES for k in compose[s]["environment"]}
    theirs = {e["name"] for s in SERVICES for e in k8s[s].get("env", [])}
    assert set(ONLY_K8S) <= theirs - ours
    assert set(ONLY_COMPOSE) <= ours - theirs


def _normal(value: str) -> str:
    """A URL's password out (compose's from .env, the manifests' $(NATS_PASSWORD))."""
    url = urlsplit(value)
    if url.password is None:
        return value
    return value.replace(f":{url.password}@", ":*@")


def _is_default(name: str, value: str) -> bool:
    prefix = next(p for p in SETTINGS if name.startswith(p))
    field = SETTINGS[prefix].model_fields[name.removeprefix(prefix).lower()]
    return str(field.default) == value
