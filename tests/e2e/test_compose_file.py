"""docker-compose.yml as compose reads it: valid, and wired the way docs/deploy.md says."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from compose_hosts import COMPOSE_FILE, ROOT, compose_config
from service_settings import SETTINGS

from tokenyard.net import is_wildcard


@pytest.fixture(scope="module")
def services() -> dict:
    return compose_config()["services"]


def tokenyard(services: dict) -> dict:
    return {n: s for n, s in services.items() if s.get("image") == "tokenyard:local"}


def test_docker_compose_validates_the_file():
    cmd = ["docker-compose", "-f", str(COMPOSE_FILE), "config", "--quiet"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_every_service_has_a_healthcheck_and_waits_for_healthy_dependencies(services):
    assert {"nats", "redis", "postgres", "router", "prefill", "decode", "kvcache"} <= set(services)
    assert {"facilities", "gateway"} <= set(services)
    for name, spec in services.items():
        assert spec.get("healthcheck", {}).get("test"), name
        for dep, cond in spec.get("depends_on", {}).items():
            assert cond["condition"] == "service_healthy", (name, dep)
    for name, spec in tokenyard(services).items():
        assert "nats" in spec["depends_on"] or name == "kvcache", name


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
