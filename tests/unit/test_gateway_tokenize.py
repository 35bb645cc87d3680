"""/tokenize and /detokenize over ASGI with the character tokenizer (no worker needed)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from gateway_fakes import BOS, MODEL, fake_state

from tokenyard.services.gateway.app import create_app


@pytest.fixture
def http():
    state = fake_state()
    with TestClient(create_app(state.settings, state), raise_server_exceptions=False) as client:
        yield client


def ids(text: str) -> list[int]:
    return [ord(c) + 10 for c in text]


def test_tokenize_a_prompt_with_and_without_special_tokens(http):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "count": 3,
        "max_model_len": 256,
        "tokens": [BOS, *ids("hi")],
        "token_strs": None,
    }
    r = http.post(
        "/tokenize", json={"prompt": "hi", "add_special_tokens": False, "return_token_strs": True}
    )
    assert r.json()["tokens"] == ids("hi") and r.json()["token_strs"] == ["h", "i"]


def test_tokenize_messages_with_and_without_the_generation_prompt(http):
    messages = [{"role": "user", "content": "hi"}]
    r = http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == ids("<user>hi\n<assistant>")
    r = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert r.json()["tokens"] == ids("<user>hi\n")
    r = http.post("/tokenize", json={"messages": messages, "add_special_tokens": True})
    assert r.json()["tokens"] == [BOS, *ids("<user>hi\n<assistant>")]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),
        ({}, None),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            "continue_final_message",
        ),
        ({"prompt": 3}, "prompt"),
    ],
)
def test_tokenize_refuses_bad_bodies_naming_the_field(http, body, param):
    r = http.post("/tokenize", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_unknown_model_is_404(http):
    r = http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(http):
    r = http.post("/detokenize", json={"model": MODEL, "tokens": ids("héllo")})
    assert r.status_code == 200 and r.json() == {"prompt": "héllo"}
    r = http.post("/detokenize", json={"tokens": [0x11000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = http.post("/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens.0"
