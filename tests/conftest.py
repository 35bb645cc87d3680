"""Fixtures shared across the suite. The default model is loaded once per session."""

from __future__ import annotations

from collections.abc import Callable

import pytest


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
        return LLMEngine(EngineConfig(**kwargs), loaded=loaded_model)

    return make


@pytest.fixture(scope="session")
def engine(make_engine):
    """A shared engine for tests that leave it empty (they must abort what they add)."""
    return make_engine()
