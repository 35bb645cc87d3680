"""The OpenAI API of a real stack (gateway -> router -> prefill -> decode over NATS, the real
engine on the CPU), driven with the official `openai` client.

Uses the suite's `stack` fixture (tests/e2e/conftest.py), or with TOKENYARD_E2E_GATEWAY_URL
set, a stack that is already running.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

from tokenyard.services.gateway import schemas

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, model, **kw):
    kw.setdefault("messages", HELLO)
    kw.setdefault("max_tokens", 16)
    return client.chat.completions.create(model=model, **kw)


def test_chat_streamed_equals_whole(client, model):
    whole = chat(client, model, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    u = whole.usage
    assert (
        u.prompt_tokens > 0
        and 0 < u.completion_tokens <= 16
        and u.total_tokens == u.prompt_tokens + u.completion_tokens
    )
    chunks = list(
        chat(client, model, temperature=0, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_completions_streamed_equals_whole(client, model):
    kw = {
        "model": model,
        "prompt": "The sky is",
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**kw)
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    streamed = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_max_tokens_and_max_completion_tokens(client, model):
    for kw in ({"max_tokens": 5}, {"max_completion_tokens": 5, "max_tokens": None}):
        out = chat(client, model, extra_body={"ignore_eos": True}, **kw)
        assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text(client, model):
    text = chat(client, model, temperature=0, max_tokens=24).choices[0].message.content
    words = [w for w in text.split() if len(w) > 2]
    stop = words[min(2, len(words) - 1)]
    cut = chat(client, model, temperature=0, max_tokens=24, stop=[stop, "@@@"])
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].message.content
    assert text.startswith(cut.choices[0].message.content)


def test_logprobs_shapes(client, model):
    out = chat(
        client, model, max_tokens=6, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for tok in content:
        assert (
            tok.logprob <= 0
            and len(tok.top_logprobs) == 2
            and tok.bytes == list(tok.token.encode())
        )
        assert max(t.logprob for t in tok.top_logprobs) >= tok.logprob - 1e-4
    legacy = client.completions.create(
        model=model, prompt="One, two,", max_tokens=4, logprobs=1, extra_body={"ignore_eos": True}
    )
    lp = legacy.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    )
    text = legacy.choices[0].text
    # each token sits at its offset in the text; a special token (an end of turn the model
    # may emit under ignore_eos) is listed but takes no room, since the text skips those
    ends = [*lp.text_offset[1:], len(text)]
    shown = [tok for tok, a, b in zip(lp.tokens, lp.text_offset, ends, strict=True) if b > a]
    assert lp.text_offset[0] == 0 and "".join(shown) == text
    assert all(
        text[a:b] in ("", tok) for tok, a, b in zip(lp.tokens, lp.text_offset, ends, strict=True)
    )


def test_seed_gives_the_same_text_twice(client, model):
    runs = [
        chat(client, model, temperature=1.0, seed=1234, max_tokens=20).choices[0].message.content
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_sixteen_concurrent_streams_complete(url, model):
    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await aclient.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            max_tokens=12,
            stream=True,
        )
        text, reason = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                reason = c.choices[0].finish_reason or reason
        return text, reason

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=180
        ) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(16)))

    results = asyncio.run(main())
    assert len(results) == 16 and all(
        text and reason in ("stop", "length") for text, reason in results
    )


BAD_INPUTS = [
    ({"messages": [], "max_tokens": 4}, 400, "messages"),
    ({"messages": HELLO, "n": 129}, 400, "n"),  # n up to 128 is served (choices)
    ({"messages": HELLO, "temperature": 9}, 400, "temperature"),
    ({"messages": HELLO, "max_tokens": 10**7}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "word " * 20_000}]}, 400, "messages"),
    ({"messages": HELLO, "model": "no-such-model"}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_INPUTS)
def test_bad_inputs_get_openai_errors(url, model, body, status, param):
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, **body}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    if "word " in json.dumps(body):
        assert "maximum context length" in error["message"]


def test_malformed_and_unknown(url):
    r = httpx.post(
        f"{url}/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["error"]["code"] == "json_invalid"
    r = httpx.get(f"{url}/v1/engines")
    assert r.status_code == 404 and "error" in r.json()


def blocks_free(url: str) -> bool:
    workers = httpx.get(f"{url}/ready", timeout=5).json()["workers"]
    return bool(workers) and all(
        w["num_free_blocks"] == w["num_blocks"] and w["num_running"] == 0 for w in workers
    )


def long_stream(model: str) -> dict:
    """A streamed chat request that runs long enough to be cut off mid-generation."""
    return {
        "model": model,
        "messages": HELLO,
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
    }


def wait_blocks_free(url: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if blocks_free(url):
            return
        time.sleep(0.25)
    raise AssertionError(f"blocks not freed: {httpx.get(f'{url}/ready').json()['workers']}")


def busy(url: str, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not blocks_free(url):
            return True
        time.sleep(0.1)
    return False


def test_stream_disconnect_frees_blocks(url, model):
    wait_blocks_free(url)
    body = long_stream(model)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert busy(url)
    wait_blocks_free(url)


def test_non_streaming_disconnect_frees_blocks(url, model):
    wait_blocks_free(url)
    body = {"model": model, "messages": HELLO, "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=3))
    wait_blocks_free(url)


def test_openapi_matches_the_server(url, model, client):
    doc = httpx.get(f"{url}/openapi.json").json()
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
    } <= set(doc["paths"])

    def documented(method: str, path: str, status: int, content: str = "application/json"):
        ref = doc["paths"][path][method]["responses"][str(status)]["content"][content]["schema"][
            "$ref"
        ]
        return getattr(schemas, ref.rsplit("/", 1)[-1])

    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": HELLO, "max_tokens": 3},
        timeout=60,
    )
    documented("post", "/v1/chat/completions", 200).model_validate(r.json())
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": "Hi", "max_tokens": 3, "stream": True},
        timeout=60,
    )
    event = documented("post", "/v1/completions", 200, "text/event-stream")
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            event.model_validate_json(line[len("data: ") :])
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hi", "suffix": "!"})
    assert r.status_code == 400
    documented("post", "/v1/completions", 400).model_validate(r.json())
    documented("get", "/v1/models", 200).model_validate(httpx.get(f"{url}/v1/models").json())
    documented("get", "/ready", 200).model_validate(httpx.get(f"{url}/ready").json())
    # the request schema the document names is the one the server validates with
    req = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "max_completion_tokens", "top_logprobs", "stream_options", "seed"} <= set(
        req["properties"]
    )


def test_metrics_after_traffic(url):
    text = httpx.get(f"{url}/metrics").text
    assert 'tokenyard_gateway_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert "tokenyard_gateway_ttft_seconds_bucket" in text


def test_api_keys_and_rate_limit_on_a_gateway_of_their_own(request, model):
    """A second gateway on the same NATS, with keys and a 1-request-per-2-s bucket of 2."""
    from openai_gateway_proc import gateway_process

    if os.environ.get("TOKENYARD_E2E_GATEWAY_URL"):
        pytest.skip("needs the stack's NATS URL")
    stack = request.getfixturevalue("stack")
    settings = {"api_keys": "k1,k2", "rate_limit_rps": "0.5", "rate_limit_burst": "2"}
    with gateway_process(stack.nats_url, **settings) as gateway:
        url = gateway.url
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0, timeout=120)
        for _ in range(2):
            chat(good, model, max_tokens=2)
        with pytest.raises(openai.RateLimitError) as info:
            chat(good, model, max_tokens=2)
        assert int(info.value.response.headers["retry-after"]) >= 1
        other = openai.OpenAI(base_url=f"{url}/v1", api_key="k2", max_retries=0, timeout=120)
        assert chat(other, model, max_tokens=2).choices  # each key has its own bucket


def test_sigterm_mid_stream_stops_the_gateway_and_frees_blocks(request, model):
    from openai_gateway_proc import gateway_process

    if os.environ.get("TOKENYARD_E2E_GATEWAY_URL"):
        pytest.skip("needs the stack's NATS URL")
    stack = request.getfixturevalue("stack")
    wait_blocks_free(stack.gateway_url)
    body = long_stream(model)
    with (
        gateway_process(stack.nats_url, shutdown_grace_s="1") as gateway,
        httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as r,
    ):
        next(r.iter_lines())
        gateway.proc.terminate()
        t0 = time.monotonic()
        # uvicorn ends by re-raising the signal it caught: -SIGTERM is a clean stop
        assert gateway.proc.wait(15) in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 10
    wait_blocks_free(stack.gateway_url)
