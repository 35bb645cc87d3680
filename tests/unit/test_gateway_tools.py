"""Tool calls and several choices through the gateway, on a scripted backend: parsing, the
OpenAI shapes (whole and streamed, as the official client reads them), usage, best_of."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient
from gateway_fakes import MODEL, FakeBackend, fake_state, text_chunks

from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.tools import ToolStreamParser, parse

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def oai(backend):
    state = fake_state(backend, max_model_len=4096)
    with TestClient(create_app(state.settings, state)) as http:
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
        )


def test_parse_keeps_only_valid_calls_to_known_tools():
    content, calls = parse("Sure. " + CALL + "\n" + CALL.replace("Paris", "Rome"), {"get_weather"})
    assert content == "Sure."
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c.id for c in calls}) == 2
    for bad in (CALL.replace("get_weather", "other"), "<tool_call>{oops</tool_call>"):
        assert parse(bad, {"get_weather"}) == (bad, [])


def test_stream_parser_holds_back_a_tag_until_it_is_one():
    parser = ToolStreamParser({"get_weather"})
    assert parser.feed("Hi <") == ("Hi ", [])
    assert parser.feed("b>") == ("<b>", [])
    out = [parser.feed(CALL[i : i + 5]) for i in range(0, len(CALL), 5)]
    calls = [c for _, cs in out for c in cs]
    assert "".join(t for t, _ in out) == "" and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}


def test_tool_call_answer_whole_and_streamed(oai, backend):
    backend.script = text_chunks(CALL, per_chunk=7)
    out = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    stream = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert not "".join(d.delta.content or "" for d in deltas)
    assert deltas[-1].finish_reason == "tool_calls"


def test_plain_text_with_tools_stays_content(oai, backend):
    backend.script = text_chunks("It is sunny <3")
    out = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    assert out.choices[0].message.content == "It is sunny <3"
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"


def test_n_choices_whole_and_streamed_with_summed_usage(oai, backend):
    out = oai.chat.completions.create(model=MODEL, messages=ASK, n=3, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content == "Hello world" for c in out.choices)
    assert out.usage.completion_tokens == 3 * 11 and out.usage.prompt_tokens == 5
    rids = [s[0] for s in backend.submitted]
    assert rids[1:] == [f"{rids[0]}-1", f"{rids[0]}-2"]
    assert [s[3].seed for s in backend.submitted] == [7, 8, 9]  # a seed of its own per choice
    stream = oai.chat.completions.create(
        model=MODEL, messages=ASK, n=2, stream=True, stream_options={"include_usage": True}
    )
    text: dict[int, str] = {0: "", 1: ""}
    ends = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                ends[c.index] = c.finish_reason
    assert text == {0: "Hello world", 1: "Hello world"} and ends == {0: "stop", 1: "stop"}
    assert usage.completion_tokens == 22


def test_best_of_returns_the_most_likely_and_echo(oai, backend):
    backend.script = text_chunks("ab", logprobs=True)
    out = oai.completions.create(model=MODEL, prompt="Say", n=1, best_of=3, echo=True)
    assert len(out.choices) == 1 and out.choices[0].text == "Sayab"
    assert out.choices[0].logprobs is None  # used for ranking, not asked for
    assert out.usage.completion_tokens == 6 and len(backend.submitted) == 3
