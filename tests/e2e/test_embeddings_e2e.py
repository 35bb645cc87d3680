"""Embeddings, /tokenize, /detokenize and batched completion prompts on a real stack (the
default model, router, prefill and decode workers over NATS), driven by the official
`openai` SDK and LangChain's `OpenAIEmbeddings`. The engine's vectors are held to HF within
1e-4 in tests/integration/test_engine_embeddings.py; here, what the clients see."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from langchain_openai import OpenAIEmbeddings

pytestmark = pytest.mark.slow

TEXTS = ["The cat sat on the mat.", "A feline rested on the rug.", "Quarterly revenue rose 4%."]


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_sdk_embeds_a_batch(client, model):
    out = client.embeddings.create(model=model, input=TEXTS)  # base64 on the wire
    vectors = [d.embedding for d in out.data]
    assert [d.index for d in out.data] == [0, 1, 2]
    assert len({len(v) for v in vectors}) == 1 and len(vectors[0]) > 64
    assert all(abs(norm(v) - 1.0) < 1e-4 for v in vectors)
    assert out.usage.prompt_tokens > len(TEXTS)
    # the same input alone gives the same vector as in the batch
    alone = client.embeddings.create(model=model, input=TEXTS[1], encoding_format="float")
    assert dot(alone.data[0].embedding, vectors[1]) > 0.9999


def test_sdk_dimensions_and_token_ids(client, model, url):
    full = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    short = client.embeddings.create(model=model, input=TEXTS[0], dimensions=32)
    head = full.data[0].embedding[:32]
    expected = [x / norm(head) for x in head]
    assert len(short.data[0].embedding) == 32
    assert all(abs(a - b) < 1e-5 for a, b in zip(short.data[0].embedding, expected, strict=True))
    ids = httpx.post(f"{url}/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model=model, input=[ids], encoding_format="float")
    assert dot(by_ids.data[0].embedding, full.data[0].embedding) > 0.9999
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=model, input="x", dimensions=100_000)


def test_langchain_openai_embeddings(client, model, url):
    embedder = OpenAIEmbeddings(
        model=model,
        base_url=f"{url}/v1",
        api_key="none",
        check_embedding_ctx_length=False,  # send the strings, not tiktoken's ids
        max_retries=0,
    )
    docs = embedder.embed_documents(TEXTS)
    query = embedder.embed_query(TEXTS[0])
    sdk = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert len(docs) == 3
    for ours, theirs in zip(docs, sdk.data, strict=True):
        assert dot(ours, theirs.embedding) > 0.9999
    assert dot(query, docs[0]) > 0.9999


def test_tokenize_and_detokenize_round_trip(url, model):
    r = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > 0
    back = httpx.post(f"{url}/detokenize", json={"model": model, "tokens": body["tokens"]})
    assert back.json()["prompt"].endswith("Hello world")
    chat = httpx.post(
        f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hello world"}]}
    ).json()
    bare = httpx.post(
        f"{url}/tokenize",
        json={
            "messages": [{"role": "user", "content": "Hello world"}],
            "add_generation_prompt": False,
        },
    ).json()
    assert chat["count"] > bare["count"] and chat["tokens"][: bare["count"]] == bare["tokens"]


def test_completions_with_a_batch_of_prompts(client, model, url):
    prompts = ["The capital of France is", "One, two, three,"]
    out = client.completions.create(
        model=model, prompt=prompts, n=2, max_tokens=4, temperature=0, seed=1
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    alone = [
        client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0).choices[0]
        for p in prompts
    ]
    by_index = {c.index: c.text for c in out.choices}
    assert by_index[0] == by_index[1] == alone[0].text  # greedy: the same for each choice
    assert by_index[2] == by_index[3] == alone[1].text
    counts = [httpx.post(f"{url}/tokenize", json={"prompt": p}).json()["count"] for p in prompts]
    assert out.usage.prompt_tokens == sum(counts)  # each prompt once, however many choices
    stream = client.completions.create(
        model=model, prompt=prompts, max_tokens=4, temperature=0, stream=True
    )
    texts: dict[int, str] = {}
    for event in stream:
        for c in event.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: alone[0].text, 1: alone[1].text}
