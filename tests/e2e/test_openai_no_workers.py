"""A real gateway process on its own NATS with no router and no workers: it starts, reports
itself not ready, and answers generation with a clear 503 (never a hang, never a 500)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from openai_gateway_proc import gateway_process


@pytest.fixture(scope="module")
def gateway_url(nats_url):
    with gateway_process(nats_url) as gateway:
        yield gateway.url


def test_generation_is_503_with_retry_after(gateway_url):
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    t0 = time.monotonic()
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=stream,
            )
        assert info.value.status_code == 503
        assert info.value.response.headers.get("retry-after")
        assert info.value.body["message"]  # OpenAI's error shape, as the client reads it
    assert time.monotonic() - t0 < 5


def test_not_ready_but_healthy(gateway_url):
    assert httpx.get(f"{gateway_url}/health").status_code == 200
    ready = httpx.get(f"{gateway_url}/ready")
    assert ready.status_code == 503
    assert ready.json()["nats_connected"] is True and ready.json()["workers"] == []
