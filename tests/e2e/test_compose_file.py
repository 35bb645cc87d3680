"""docker-compose.yml as compose reads it: valid, and wired the way docs/deploy.md says."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from compose_hosts import NATS_PASSWORDS, ROOT, compose_config, run_compose
from service_settings import SETTINGS

from tokenyard.bus import auth
from tokenyard.bus.nats_config import config_text
from tokenyard.net import is_wildcard

OBSERVABILITY = {"otel-collector", "prometheus", "grafana"}
# The NATS user of each Tokenyard service (a pool's replicas share their pool's).
NATS_USERS = {
    "router": "router",
    "gateway": "gateway",
    "prefill": "prefill",
    "decode": "decode",
    "facilities": "facilities",
    "telemetry": "telemetry",
}


@pytest.fixture(scope="module")
def services() -> dict:
    return compose_config()["services"]


def tokenyard(services: dict) -> dict:
    return {n: s for n, s in services.items() if s.get("image") == "tokenyard:local"}


@pytest.mark.parametrize("profile", [[], ["--profile", "observability"]])
def test_docker_compose_validates_the_file(profile):
    result = run_compose(*profile, "config", "--quiet", env=NATS_PASSWORDS, check=False)
    assert result.returncode == 0, result.stderr


def test_without_the_nats_passwords_compose_refuses_and_says_what_to_run():
    result = run_compose("config", "--quiet", env={}, check=False)
    assert result.returncode != 0
    assert "tokenyard nats-config --format env >> .env" in result.stderr


def test_every_service_has_a_healthcheck_and_waits_for_healthy_dependencies(services):
    assert {"nats", "redis", "postgres", "router", "prefill", "decode", "kvcache"} <= set(services)
    assert {"facilities", "gateway", "telemetry"} <= set(services)
    for name, spec in services.items():
        # The collector's image has no program to probe it with; nothing waits on it.
        if name == "otel-collector":
            assert spec["healthcheck"] == {"test": ["NONE"]}  # `disable: true`, resolved
            assert not any("otel-collector" in s.get("depends_on", {}) for s in services.values())
            continue
        assert spec.get("healthcheck", {}).get("test"), name
        for dep, cond in spec.get("depends_on", {}).items():
            assert cond["condition"] == "service_healthy", (name, dep)
    for name, spec in tokenyard(services).items():
        assert "nats" in spec["depends_on"] or name == "kvcache", name


def test_every_service_restarts_and_probes_the_way_the_launcher_does(services):
    """`unless-stopped`, as `tokenyard up` restarts a crashed service; readiness on /ready
    for the services with an ops server, liveness (/health) for the HTTP APIs."""
    for name, spec in services.items():
        assert spec["restart"] == "unless-stopped", name
    for name, spec in tokenyard(services).items():
        probe = " ".join(spec["healthcheck"]["test"])
        path = "/health" if name in ("gateway", "facilities") else "/ready"
        assert "'http://localhost:" in probe and f"{path}'" in probe, name


def test_the_telemetry_console_is_served_and_waits_for_the_database_migration(services):
    telemetry = services["telemetry"]
    env = telemetry["environment"]
    port = int(env["TOKENYARD_TELEMETRY_PORT"])
    assert [p["target"] for p in telemetry["ports"]] == [port]
    assert env["TOKENYARD_TELEMETRY_HOST"] == "0.0.0.0"
    assert f"localhost:{port}/ready" in " ".join(telemetry["healthcheck"]["test"])
    # Facilities and telemetry share the database; facilities migrates it first.
    assert (
        env["TOKENYARD_TELEMETRY_DB_URL"]
        == (services["facilities"]["environment"]["TOKENYARD_FACILITIES_DB_URL"])
    )
    assert set(telemetry["depends_on"]) == {"nats", "postgres", "facilities"}
    facilities_port = services["facilities"]["environment"]["TOKENYARD_FACILITIES_PORT"]
    assert env["TOKENYARD_TELEMETRY_FACILITIES_URL"] == f"http://facilities:{facilities_port}"


def test_nats_has_the_generated_users_and_each_service_its_own(services):
    nats = services["nats"]
    command = nats["command"]
    config = command[command.index("--config") + 1]
    mount = next(v for v in nats["volumes"] if v.endswith(f":{config}:ro"))
    assert (ROOT / "infra" / "nats" / "users.conf").samefile(mount.split(":")[0])
    assert Path(mount.split(":")[0]).read_text() == config_text()
    # The server gets every user's password from the environment, none is in the file.
    variables = {auth.password_variable(u.name) for u in auth.deployment_users()}
    assert set(nats["environment"]) == variables
    for name, spec in tokenyard(services).items():
        if name == "kvcache":  # gRPC only, no NATS
            continue
        url = urlsplit(next(v for k, v in spec["environment"].items() if k.endswith("_NATS_URL")))
        assert (url.hostname, url.port) == ("nats", 4222), name
        assert url.username == NATS_USERS[name], name
        assert url.password == NATS_PASSWORDS[auth.password_variable(url.username)], name


def test_the_observability_profile_runs_apart_and_scrapes_the_services(services):
    profiled = {n for n, s in services.items() if s.get("profiles")}
    assert profiled == OBSERVABILITY
    assert all(services[n]["profiles"] == ["observability"] for n in profiled)
    assert not any(
        set(s.get("depends_on", {})) & OBSERVABILITY for s in tokenyard(services).values()
    )
    prometheus = yaml.safe_load((ROOT / "infra/prometheus/prometheus.yml").read_text())
    for job in prometheus["scrape_configs"]:
        names = [t.split(":")[0] for s in job.get("static_configs", []) for t in s["targets"]]
        names += [n for d in job.get("dns_sd_configs", []) for n in d["names"]]
        assert set(names) <= set(services), job["job_name"]
    # Every scraped ops server listens beyond its container's loopback.
    for name in ("router", "prefill", "decode", "kvcache"):
        env = services[name]["environment"]
        assert next(v for k, v in env.items() if k.endswith("_OPS_HOST")) == "0.0.0.0", name
    # Spans go to the collector only when the operator says so (empty: no OTLP export).
    for spec in tokenyard(services).values():
        assert spec["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == ""


def test_every_tokenyard_setting_exists(services):
    """A misspelt variable would be silently ignored by pydantic-settings."""
    for name, spec in tokenyard(services).items():
        for key in spec["environment"]:
            if not key.startswith("TOKENYARD_"):
                continue
            prefix = next(p for p in SETTINGS if key.startswith(p))
            field = key.removeprefix(prefix).lower()
            assert field in SETTINGS[prefix].model_fields, f"{name}: {key} is no setting"


def test_nats_keeps_jetstream_on_a_volume(services):
    nats = services["nats"]
    command = nats["command"]
    store = command[command.index("--store_dir") + 1]
    assert "--jetstream" in command
    assert any(v.endswith(f":{store}:rw") and not v.startswith("/") for v in nats["volumes"])


def test_workers_scale_advertise_and_use_the_kv_cache(services):
    kvcache = services["kvcache"]["environment"]
    assert kvcache["TOKENYARD_KVCACHE_REDIS_URL"].startswith("redis://redis:")
    for role in ("prefill", "decode"):
        spec = services[role]
        env = spec["environment"]
        assert env["TOKENYARD_WORKER_ROLE"] == role
        # --scale: no fixed name, no host port two replicas would fight over.
        assert "container_name" not in spec and "ports" not in spec
        assert env["TOKENYARD_WORKER_KVCACHE_ENDPOINT"] == (
            f"kvcache:{kvcache['TOKENYARD_KVCACHE_PORT']}"
        )
        assert not is_wildcard(env.get("TOKENYARD_WORKER_ADVERTISE_HOST", "derived"))
        # A KV pool in /dev/shm needs the room for it; Docker gives 64 MiB.
        if env.get("TOKENYARD_WORKER_KV_SHARED_MEMORY", "true") != "false":
            assert _bytes(spec.get("shm_size", "64m")) > int(env["TOKENYARD_WORKER_KV_CACHE_BYTES"])
    assert _bytes(services["postgres"]["shm_size"]) >= 128 << 20


def test_every_mounted_file_exists(services):
    for spec in services.values():
        for volume in spec.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("/"):
                assert Path(source).exists(), source


def _bytes(size: str | int) -> int:
    if isinstance(size, int):
        return size
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    size = size.lower().rstrip("b")
    return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
