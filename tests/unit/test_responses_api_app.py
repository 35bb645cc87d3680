"""POST/GET/DELETE /v1/responses over ASGI with a fake backend and a real SQLite store,
driven by the official `openai` client: create, stream, continue, retrieve, delete, tenants,
and a 400 naming each field this server does not serve."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import openai
import pytest
from fastapi.testclient import TestClient
from gateway_fakes import MODEL, CharTokenizer, FakeBackend, fake_state

from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.responses_api.store import ResponseStore

KEYS = ["key-a", "key-b"]


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(script="Hello there")


@pytest.fixture
def http(backend, tmp_path):
    state = fake_state(backend, api_keys=KEYS, max_model_len=4096)
    state.responses = ResponseStore.open(f"sqlite:///{tmp_path / 'r.db'}", retention_s=3600)
    with TestClient(create_app(state.settings, state), raise_server_exceptions=False) as client:
        yield client
    state.responses.close()


def sdk(http, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0
    )


def last_prompt(backend: FakeBackend) -> str:
    return CharTokenizer().decode(backend.submitted[-1][2])


def test_create_continue_retrieve_delete(http, backend):
    oai = sdk(http)
    first = oai.responses.create(model=MODEL, input="hi", instructions="Be kind.")
    assert first.status == "completed" and first.output_text == "Hello there"
    assert first.usage.output_tokens == len("Hello there")
    assert last_prompt(backend) == "<system>Be kind.\n<user>hi\n<assistant>"

    second = oai.responses.create(model=MODEL, input="again", previous_response_id=first.id)
    # The earlier turn and its answer, without the earlier instructions.
    assert last_prompt(backend) == "<user>hi\n<assistant>Hello there\n<user>again\n<assistant>"
    assert second.previous_response_id == first.id

    assert oai.responses.retrieve(first.id).output_text == "Hello there"
    items = http.get(f"/v1/responses/{second.id}/input_items", headers=auth("key-a")).json()
    assert [i["role"] for i in items["data"]] == ["user", "assistant", "user"]
    assert oai.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    # A stored descendant keeps its whole conversation.
    oai.responses.create(model=MODEL, input="third", previous_response_id=second.id)
    assert last_prompt(backend).startswith("<user>hi\n<assistant>Hello there\n<user>again")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_stream_ends_with_the_stored_response(http, backend):
    oai = sdk(http)
    with oai.responses.stream(model=MODEL, input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello there"
    assert oai.responses.retrieve(final.id).output_text == "Hello there"


def test_store_false_keeps_nothing(http):
    oai = sdk(http)
    out = oai.responses.create(model=MODEL, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(out.id)
    r = http.post(
        "/v1/responses",
        json={"model": MODEL, "input": "x", "previous_response_id": out.id},
        headers=auth("key-a"),
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_another_tenant_cannot_see_or_delete_a_response(http):
    mine = sdk(http, "key-a").responses.create(model=MODEL, input="hi")
    theirs = sdk(http, "key-b")
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(mine.id)
    with pytest.raises(openai.BadRequestError):
        theirs.responses.create(model=MODEL, input="x", previous_response_id=mine.id)
    assert sdk(http, "key-a").responses.retrieve(mine.id).id == mine.id


def test_function_call_round_trip(http, backend):
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
    }
    backend.script = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    oai = sdk(http)
    out = oai.responses.create(model=MODEL, input="weather?", tools=[tool], tool_choice="required")
    call = out.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert backend.submitted[-1][3].guided.kind == "grammar"  # the forced call's grammar
    backend.script = "Sunny."
    answer = oai.responses.create(
        model=MODEL,
        previous_response_id=out.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[tool],
    )
    assert answer.output_text == "Sunny."
    assert "<tool>sunny\n<assistant>" in last_prompt(backend)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.message.content.0",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    ],
)
def test_unsupported_fields_are_refused_by_name(http, body, param):
    r = http.post(
        "/v1/responses", json={"model": MODEL, "input": "hi", **body}, headers=auth("key-a")
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_expired_responses_are_gone_and_purged(tmp_path):
    now = [datetime(2026, 1, 1, tzinfo=UTC)]
    store = ResponseStore.open(f"sqlite:///{tmp_path / 'e.db'}", retention_s=60)
    store.clock = lambda: now[0]
    store.save("t", {"id": "resp_1", "output": []}, [])
    assert store.get("resp_1", "t") is not None and store.get("resp_1", "u") is None
    now[0] += timedelta(seconds=61)
    assert store.get("resp_1", "t") is None
    assert store.purge() == 1 and store.purge() == 0
    store.close()


@pytest.mark.parametrize("stream", [False, True])
def test_calls_are_read_in_the_served_models_format(tmp_path, stream):
    """A gateway serving a Llama 3 model reads its JSON calls, whole and streamed, as the
    chat path does (--tool-call-parser), not the Hermes tags."""
    backend = FakeBackend(script='{"name": "get_weather", "parameters": {"city": "Paris"}}')
    state = fake_state(backend, api_keys=KEYS, max_model_len=4096, tool_call_parser="llama3_json")
    state.responses = ResponseStore.open(f"sqlite:///{tmp_path / 'r.db'}", retention_s=3600)
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
    }
    with TestClient(create_app(state.settings, state), raise_server_exceptions=False) as http:
        oai = sdk(http)
        if stream:
            with oai.responses.stream(model=MODEL, input="weather?", tools=[tool]) as events:
                out = events.get_final_response()
        else:
            out = oai.responses.create(model=MODEL, input="weather?", tools=[tool])
    state.responses.close()
    assert [item.type for item in out.output] == ["function_call"]
    assert out.output[0].name == "get_weather"
    assert out.output[0].arguments == '{"city": "Paris"}'


@pytest.mark.parametrize("stream", [False, True])
def test_a_reasoning_models_thinking_is_left_out_of_the_output(tmp_path, stream):
    backend = FakeBackend(script="<think>Paris is in France.</think>\n\nIt is sunny.")
    state = fake_state(backend, max_model_len=4096, reasoning_parser="qwen3")
    state.responses = ResponseStore.open(f"sqlite:///{tmp_path / 'r.db'}", retention_s=3600)
    with TestClient(create_app(state.settings, state), raise_server_exceptions=False) as http:
        oai = sdk(http)
        if stream:
            with oai.responses.stream(model=MODEL, input="weather?") as events:
                deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
                out = events.get_final_response()
            assert "".join(deltas) == "It is sunny."
        else:
            out = oai.responses.create(model=MODEL, input="weather?")
    state.responses.close()
    assert out.output_text == "It is sunny."
